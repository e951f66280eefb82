"""``spotgpu admin image build``'s decisions on plain data (``cli/image_recipe.py``): the
wheelhouse's and the base's checks, each refusal saying what to change; the recipe; the tag and
reference; what a failed install means. The command itself on a real engine and registry:
``test_image_build.py``."""

from __future__ import annotations

import doctest

import pytest

from prefect_spotgpu.cli import image_recipe as recipe
from prefect_spotgpu.cli.image_recipe import BaseProbe, Plan, Wheel, Wheelhouse

HOUSE = Wheelhouse(
    package=Wheel("prefect_spotgpu-0.1.0-py3-none-any.whl", "0.1.0", ">=3.11"),
    prefect=Wheel("prefect-3.9.1-py3-none-any.whl", "3.9.1", "<3.16,>=3.11"),
    wheels=120,
)
GOOD = BaseProbe(python="/opt/conda/bin/python", version=(3, 11, 10), pip=True,
                 python_on_path="/opt/conda/bin/python", platform="linux-x86_64")  # fmt: skip


def test_the_doctests_hold():
    assert doctest.testmod(recipe).failed == 0


def test_a_wheelhouse_needs_a_prefect_spotgpu_wheel_and_says_how_to_make_one():
    assert recipe.wheelhouse_problem("wh", ["prefect_spotgpu-0.1.0-py3-none-any.whl"]) is None
    empty = recipe.wheelhouse_problem("wh", ["README"])
    assert empty.startswith("the wheelhouse wh holds no wheels")
    others = recipe.wheelhouse_problem("wh", ["numpy-2.0.0-cp311-cp311-linux_x86_64.whl"])
    assert "holds no prefect-spotgpu wheel (prefect_spotgpu-*.whl)" in others
    for said in (empty, others):
        assert "pip wheel prefect-spotgpu -w DIR (from a clone: pip wheel . -w DIR)" in said
        assert "docs/operators/image-catalogue.md#the-wheelhouse" in said
    newest = recipe.newest([Wheel("a", "0.9.0"), Wheel("b", "0.10.0"), Wheel("c", "0.2")])
    assert newest.version == "0.10.0"  # by version, not by name


@pytest.mark.parametrize(
    ("probe", "says"),
    [
        (BaseProbe(), "the base has no Python (neither python3 nor python on its PATH)"),
        (
            BaseProbe(python="/usr/bin/python3", version=(3, 10, 12), pip=True),
            "the base's Python (/usr/bin/python3) is 3.10.12, which prefect-spotgpu 0.1.0 does "
            "not run on (prefect-spotgpu 0.1.0 needs Python >=3.11; prefect 3.9.1 needs Python "
            "<3.16,>=3.11): pick a base with a newer Python",
        ),
        (
            BaseProbe(python="/usr/bin/python3", version=(3, 16, 0), pip=True),
            "which prefect 3.9.1 does not run on",
        ),
        (
            BaseProbe(python="/usr/bin/python3", version=(3, 11, 2)),
            "has no pip and no ensurepip to bootstrap it: pick a base with pip, or add it first "
            "(Debian and Ubuntu: apt-get install python3-pip",
        ),
    ],
    ids=["no-python", "too-old", "too-new-for-prefect", "no-pip"],
)
def test_a_base_that_cannot_take_prefect_spotgpu_is_refused_saying_what_to_change(probe, says):
    assert says in recipe.base_problem(probe, HOUSE)


def test_a_base_with_pip_or_ensurepip_and_a_new_enough_python_is_taken():
    assert recipe.base_problem(GOOD, HOUSE) is None
    bootstrap = BaseProbe(python="/usr/local/bin/python3", version=(3, 12, 3), ensurepip=True)
    assert recipe.base_problem(bootstrap, HOUSE) is None
    no_prefect_wheel = Wheelhouse(package=HOUSE.package)  # the base's own Prefect, then
    assert recipe.base_problem(GOOD, no_prefect_wheel) is None


def test_the_probe_reads_the_last_json_line_of_the_bases_python():
    printed = 'noise from an entrypoint\n{"python": "/usr/bin/python3", "version": [3, 11, 2], '
    printed += '"pip": false, "ensurepip": false, "python_on_path": null, "platform": "linux"}\n'
    probe = BaseProbe.parse(printed, user="1000")
    assert probe == BaseProbe("/usr/bin/python3", (3, 11, 2), False, False, None, "linux", "1000")
    assert probe.version_text == "3.11.2"
    assert BaseProbe.parse("{}").python is None


def test_the_recipe_installs_from_the_wheelhouse_only_and_bakes_in_nothing_else():
    reference = "registry.example.com/spotgpu/pytorch:2.5.1-spotgpu0.1.0"
    text = recipe.dockerfile(Plan("pytorch/pytorch:2.5.1", GOOD, HOUSE, reference))
    lines = text.splitlines()
    assert lines[0] == "FROM pytorch/pytorch:2.5.1" and lines[1] == "USER root"
    assert "COPY wheelhouse /tmp/spotgpu-wheelhouse" in lines  # the only COPY: no flow code
    assert sum(line.startswith(("COPY", "ADD")) for line in lines) == 1
    assert (
        '"$python" -m pip install --no-cache-dir --disable-pip-version-check --no-index '
        "--find-links /tmp/spotgpu-wheelhouse prefect-spotgpu==0.1.0" in text
    )
    assert "rm -rf /tmp/spotgpu-wheelhouse" in text  # in the install's own layer
    assert "ensurepip" not in text and "ln -s" not in text  # pip and python are there
    assert 'LABEL io.spotgpu.runs-flows="true" io.spotgpu.base="pytorch/pytorch:2.5.1"' in text
    assert not lines[-1].startswith("USER")  # the base ran as root: it stays so

    bare = BaseProbe(python="/usr/bin/python3", version=(3, 11, 2), ensurepip=True, user="app")
    text = recipe.dockerfile(Plan("me/base:1", bare, HOUSE, reference))
    assert '"$python" -m ensurepip --default-pip' in text
    assert 'ln -s "$python" /usr/local/bin/python' in text  # the launcher's `python`
    assert text.splitlines()[-1] == "USER app"  # the base's user given back


def test_the_tag_and_reference_say_what_the_image_holds():
    assert (
        recipe.default_tag("pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime", "0.1.0")
        == "2.5.1-cuda12.4-cudnn9-runtime-spotgpu0.1.0"
    )
    assert recipe.default_tag("127.0.0.1:5000/base", "0.1.0") == "latest-spotgpu0.1.0"
    assert recipe.default_tag("me/base:1@sha256:" + "a" * 64, "0.1.0") == "1-spotgpu0.1.0"
    assert len(recipe.default_tag("me/base:" + "x" * 128, "0.1.0")) == 128
    assert (
        recipe.image_reference("127.0.0.1:5000/spotgpu/", "pytorch", "1")
        == "127.0.0.1:5000/spotgpu/pytorch:1"
    )
    with pytest.raises(ValueError, match="--registry is HOST"):
        recipe.image_reference("Registry Example", "pytorch", "1")
    with pytest.raises(ValueError, match="--tag letters"):
        recipe.image_reference("registry.example.com/x", "pytorch", "bad tag")


def test_a_wheel_missing_from_the_wheelhouse_is_named_with_the_python_to_make_it_for():
    log = [
        "Looking in links: /tmp/spotgpu-wheelhouse",
        "ERROR: Could not find a version that satisfies the requirement pydantic-core==2.33.2",
        "ERROR: No matching distribution found for pydantic-core==2.33.2",
    ]
    probe = BaseProbe(python="/usr/bin/python3", version=(3, 12, 3), platform="linux-x86_64")
    said = recipe.install_problem(log, probe, "./wheelhouse")
    assert said.startswith(
        "the wheelhouse ./wheelhouse has no wheel of pydantic-core==2.33.2 that the base's "
        "Python 3.12.3 (linux-x86_64) can install"
    )
    assert "--python-version 3.12" in said
    assert recipe.install_problem(["something else"], probe, "wh") is None
