# A spot-gpu job image from any image with Python 3.11+ and pip (e.g. a catalogue image:
# pytorch/pytorch, nvcr.io/nvidia/pytorch, huggingface/transformers-pytorch-gpu): it adds
# prefect-spotgpu (Prefect, the launcher `python -m prefect_spotgpu.launch`, the checkpoint
# library) and, optionally, your flow's code. Build it from the clone's root:
#
#   python -m pip wheel --no-deps -w dist .
#   docker build -f docker/job.Dockerfile --build-arg BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime \
#       --build-arg FLOWS=flows -t registry.example.com/me/pretrain:1 .
#
# then set the deployment's `image` job variable to the tag (or ask the operator to add it to
# the catalogue). tests/test_docker_e2e.py builds its flow image with this file.
ARG BASE
FROM ${BASE}
ARG FLOWS=flows
COPY dist/prefect_spotgpu-*.whl /tmp/
RUN python -m pip install -q --no-cache-dir /tmp/prefect_spotgpu-*.whl && rm /tmp/prefect_spotgpu-*.whl
COPY ${FLOWS} /opt/spotgpu-flows/
WORKDIR /opt/spotgpu-flows
