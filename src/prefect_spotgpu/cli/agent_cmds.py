"""``spotgpu agent start``: the node agent of a GPU host, in this process, until it is stopped.

The command only reads its options, builds the runner and the inventory and hands them to
``agent.Agent``; what the agent does is in ``prefect_spotgpu.agent``.
"""

from __future__ import annotations

import typer

from prefect_spotgpu.agent.isolation import UID_BASE_ENV
from prefect_spotgpu.cli.common import MARKET, console
from prefect_spotgpu.protocol import UNSET_NODE_ADDRESS, Capacity, Runner, unfit_node_address

agent_app = typer.Typer(help="Run the node agent on a GPU host.", no_args_is_help=True)


@agent_app.command("start")
def agent_start(
    market: str = MARKET,
    token_file: str = typer.Option(
        None,
        help="File holding the node's agent token (sgn_...), or the owner's API key (sgk_...) "
        "to register this host as a node (or to issue a new token to the owner's node of this "
        "name). Default: the SPOTGPU_AGENT_TOKEN environment variable. Never on the command "
        "line, which every user of the host can read. The node's token is then kept in the "
        "state directory, and neither is needed again.",
    ),
    runner: str = typer.Option(
        Runner.PROCESS.value,
        help="process (default: local processes; the single-tenant choice) or docker "
        "(containers: the multi-tenant runner).",
    ),
    gpus: str = typer.Option(
        None,
        help="Declare an inventory instead of NVML discovery, "
        "e.g. A100-80G:2 (machines without NVIDIA GPUs).",
    ),
    name: str = typer.Option(None, help="Node name when registering (default: hostname)."),
    region: str = typer.Option(None, help="Region when registering, e.g. eu-west."),
    advertise_address: str = typer.Option(
        UNSET_NODE_ADDRESS,
        envvar="SPOTGPU_AGENT_ADVERTISE_ADDRESS",
        help="The IP address or host name other nodes reach this one at: a gang whose rank 0 "
        "runs here gives it to its other ranks as MASTER_ADDR.",
    ),
    reserve_price: float = typer.Option(None, help="Reserve price per GPU-hour when registering."),
    capacity: str = typer.Option(
        Capacity.SPOT.value,
        help="spot (default: idle GPUs, auctioned, preemptible) or on_demand (sold at the "
        "model's on-demand price, never outbid) when registering.",
    ),
    state_dir: str = typer.Option(
        None,
        help="Agent state: the node token, the jobs' directories (default "
        "$SPOTGPU_HOME/agent-NAME; SPOTGPU_HOME is ~/.spotgpu, or /var/lib/spotgpu for root).",
    ),
    checkpoint_root: str = typer.Option(
        None,
        help="Where jobs' local checkpoints go: one directory per tenant (tenant-ID), which "
        "containers see at /spotgpu/checkpoints; a job's own local path is never used. Point "
        "it at storage every node shares, or a run resumes elsewhere without its local "
        "checkpoints. Default: STATE_DIR/checkpoints for the docker runner and for process "
        "jobs isolated under root; otherwise process jobs keep their own checkpoint path.",
    ),
    job_user: str = typer.Option(
        "auto",
        help="Who jobs run as when the agent runs as root. auto: each job its own uid "
        "(--job-uid-base + allocation id mod 100000) and one group per tenant (base + tenant "
        "id). A user name or uid: every job as that user (weaker: jobs share a uid, so one "
        "may read another's environment). Not as root, jobs run as the agent's user and are "
        "not isolated.",
    ),
    job_uid_base: int = typer.Option(
        200_000,
        envvar=UID_BASE_ENV,
        help="First uid of --job-user auto, also the base of the tenant gids; "
        "uids BASE..BASE+99999 and gids BASE+TENANT must be unused on the host.",
    ),
    job_python: str = typer.Option(
        None,
        help="Process runner: the interpreter a job whose command starts with python runs "
        "(default: the agent's own, which has the packages it was installed with). Under root "
        "the job users must be able to run it: the agent refuses to start otherwise.",
    ),
    default_image: str = typer.Option(
        None,
        help="Docker runner: the image (a reference, e.g. one of the market's catalogue) that a "
        "bid without an image (image 'process': the node's own environment) runs in. Without "
        "it such bids fail on this node.",
    ),
    job_subnet: str = typer.Option(
        None,
        help="Docker runner: this node's job network, a private IPv4 subnet (/16 to /24, e.g. "
        "10.88.3.0/24) that the other GPU hosts route to this host. Its containers get "
        "addresses there; gang members reach each other there and nothing else reaches them "
        "(nor do they reach this host's services). Needs root (iptables). Without it, "
        "containers are on Docker's default bridge and no gang member runs here.",
    ),
    job_pids_limit: int = typer.Option(
        4096, min=16, help="Docker runner: the most processes (and threads) per container."
    ),
    job_memory: str = typer.Option(
        None,
        help="Docker runner: memory limit per container, e.g. 64g (default: none; a GPU "
        "job's host memory varies too much for one default).",
    ),
    heartbeat_seconds: float = typer.Option(5.0, min=0.1, help="Seconds between heartbeats."),
    grace_seconds: float = typer.Option(
        5.0,
        min=0.0,
        help="SIGTERM-to-SIGKILL grace when stopping a cancelled or finished job; at a "
        "notice's end the job gets SIGKILL only (its engine must not write Crashed). Also how "
        "long a stopping agent (SIGTERM, Ctrl-C) gives its jobs to save before it kills them.",
    ),
    handover_seconds: float = typer.Option(
        20.0,
        min=1.0,
        help="After a hand-over (SIGUSR2: an upgrade), how long the jobs left running wait "
        "for the next agent on this state directory before they are killed. Keep it under the "
        "market's heartbeat timeout (SPOTGPU_HEARTBEAT_TIMEOUT_SECONDS, default 30).",
    ),
    metrics_port: int = typer.Option(
        None,
        min=0,
        max=65535,
        envvar="SPOTGPU_AGENT_METRICS_PORT",
        help="Serve the agent's own Prometheus metrics on this port, at /metrics (jobs, "
        "starts, notices, final saves, heartbeats, image pulls, the guard, hand-overs). "
        "Default: none.",
    ),
    metrics_address: str = typer.Option(
        "127.0.0.1",
        envvar="SPOTGPU_AGENT_METRICS_ADDRESS",
        help="The address --metrics-port listens on (the metrics need no key: keep them off "
        "networks your Prometheus is not on).",
    ),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
) -> None:
    """Run the node agent: discover GPUs, register, heartbeat, run assigned jobs.

    On a notice it sends SIGUSR1 to the job's main process and writes the notice file; after
    the job's final save (or at the deadline) it stops the job (SIGKILL: a preemption never
    reads as a crash) and reports the outcome. Stopped (SIGTERM, Ctrl-C), it takes its node
    back: each job gets its notice, saves and stops within --grace-seconds, and its run resumes
    elsewhere; a second signal kills the jobs at once. Its jobs never outlive it, except
    when it hands them over (SIGUSR2, for an upgrade): it exits at once and the next agent
    started on the same --state-dir within --handover-seconds adopts them. Run as
    root, it runs each job as an unprivileged user of its own (see --job-user), and refuses to
    start when that user cannot execute the job interpreter (see --job-python). A node whose
    jobs cannot start, three in a row, drains itself until its owner offers it again. With
    --metrics-port it serves its own Prometheus metrics.
    """
    import logging
    import signal as signals
    import socket
    from pathlib import Path

    from prefect_spotgpu.agent.agent import Agent, AgentError
    from prefect_spotgpu.agent.configure import (
        RunnerOptions,
        agent_token,
        build_runner,
        default_state_dir,
    )
    from prefect_spotgpu.agent.discovery import (
        DiscoveryError,
        discover_nvml,
        parse_declared,
        telemetry_nvml,
    )
    from prefect_spotgpu.agent.guard import hold_state_dir, start_guard

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if log_level.lower() != "debug":  # a line per request (one a second, at least): noise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if why := unfit_node_address(advertise_address):
        console.print(f"[red]--advertise-address {advertise_address!r} is {why}[/red]")
        raise typer.Exit(2)
    name = name or socket.gethostname()
    state = Path(state_dir).absolute() if state_dir else default_state_dir(name)
    options = RunnerOptions(
        kind=runner,
        checkpoint_root=Path(checkpoint_root) if checkpoint_root else None,
        job_user=job_user,
        job_uid_base=job_uid_base,
        pids_limit=job_pids_limit,
        memory=job_memory,
        job_python=Path(job_python) if job_python else None,
        default_image=default_image or None,
        job_subnet=job_subnet or None,
    )
    try:
        token = agent_token(token_file)
        inventory = parse_declared(gpus) if gpus else discover_nvml()
        job_runner = build_runner(options, state)
    except (DiscoveryError, ValueError) as exc:
        console.print(str(exc), style="red", markup=False, soft_wrap=True)  # it may quote input
        raise typer.Exit(2) from None
    agent = Agent(
        market=market,
        token=token,
        runner=job_runner,
        gpus=inventory,
        declared=bool(gpus),
        state_dir=state,
        name=name,
        region=region,
        reserve_price=reserve_price,
        capacity=capacity.replace("-", "_"),
        heartbeat_seconds=heartbeat_seconds,
        grace_seconds=grace_seconds,
        telemetry=None if gpus else telemetry_nvml,
        address=advertise_address,
    )
    lock = hold_state_dir(state)  # one agent at a time: a quick restart waits for the last
    agent.guard = start_guard(job_runner, state, lock)  # its jobs die with it (before threads)
    agent.handover_seconds = handover_seconds
    if metrics_port is not None:  # (a thread: after the guard's fork)
        agent.metrics.serve(metrics_address, metrics_port)
    for stop_signal in (signals.SIGTERM, signals.SIGINT):  # leave as a reclaim (twice: now)
        signals.signal(stop_signal, lambda *_: agent.shutdown())
    signals.signal(signals.SIGUSR2, lambda *_: agent.hand_over())  # an upgrade: jobs stay
    try:
        agent.run()
    except AgentError as exc:
        console.print(str(exc), style="red", markup=False, soft_wrap=True)  # it may quote input
        raise typer.Exit(1) from None
