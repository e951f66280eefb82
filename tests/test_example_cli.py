"""The example flows' command lines (``python flows/<name>.py``): ``--help`` lists the flow's
parameters, from its signature (flows/_cli.py), with their types and defaults; a run with tiny
parameters trains, cleans or renders here, without Prefect's server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FLOWS = Path(__file__).resolve().parent.parent / "flows"


def example(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80"}  # argparse's help layout depends on the width
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ["pretrain.py"],
            [
                "the flow's parameters (pretrain)",
                "--steps STEPS         int, default 300",
                "--layers LAYERS       int, default 2",
                "--width WIDTH         int, default 64",
                "--batch BATCH         int, default 16",
                "--checkpoint-minutes",
                "float, default 1.0 here; the flow's: 15.0",
                "--corpus-bytes",  # the command's own options too
                "--after-notice",
            ],
        ),
        (
            ["render.py"],
            [
                "the flow's parameters (render-animation)",
                "OUT              str",
                "--frames FRAMES  int, default 24",
                "--width WIDTH    int, default 160",
                "--height HEIGHT  int, default 120",
            ],
        ),
        (
            ["clean.py", "run"],
            ["the flow's parameters (clean-pairs)", "SOURCE", "OUT", "--make-test-set"],
        ),
    ],
)
def test_help_lists_the_flows_parameters(command, expected):
    script, *rest = command
    out = example(str(FLOWS / script), *rest, "--help").stdout
    for text in expected:
        assert text in out, out


def test_the_flows_signature_is_read_from_its_source():
    sys.path.insert(0, str(FLOWS))
    try:
        from _cli import flow_signature
    finally:
        sys.path.remove(str(FLOWS))
    signature = flow_signature(FLOWS / "pretrain.py", "pretrain")
    assert signature.name == "pretrain"
    assert [(p.name, p.annotation, p.default, p.required) for p in signature.parameters] == [
        ("steps", "int", 300, False),
        ("layers", "int", 2, False),
        ("width", "int", 64, False),
        ("batch", "int", 16, False),
        ("checkpoint_minutes", "float", 15.0, False),
    ]
    render = flow_signature(FLOWS / "render.py", "render_animation")
    assert (render.name, render.parameters[0].name, render.parameters[0].required) == (
        "render-animation",
        "out",
        True,
    )
    with pytest.raises(LookupError):
        flow_signature(FLOWS / "pretrain.py", "train")  # a function, not a flow


def test_pretrain_runs_here_with_the_given_parameters(tmp_path):
    result = tmp_path / "result.json"
    out = example(
        str(FLOWS / "pretrain.py"),
        *("--steps", "4", "--layers", "1", "--width", "32", "--batch", "4"),
        *("--corpus-bytes", "50000", "--log-every", "1"),
        *("--checkpoints", str(tmp_path / "store"), "--result", str(result)),
    ).stdout
    assert "step 4/4 loss" in out and "final loss" in out, out
    assert len(json.loads(result.read_text())["losses"]) == 4


def test_render_runs_here_with_the_given_parameters(tmp_path):
    out = example(
        str(FLOWS / "render.py"), str(tmp_path / "frames"),
        *("--frames", "2", "--width", "16", "--height", "12"),
    ).stdout  # fmt: skip
    assert "frame 2/2" in out, out
    assert sorted(p.name for p in (tmp_path / "frames").glob("frame-*.png")) == [
        "frame-0000.png",
        "frame-0001.png",
    ]


def test_clean_makes_its_test_set_and_cleans_it_here(tmp_path):
    out = example(
        str(FLOWS / "clean.py"), "run", str(tmp_path / "pairs"), str(tmp_path / "clean"),
        *("--make-test-set", "60"),
    ).stdout  # fmt: skip
    report = json.loads(out[out.index("{\n") :])
    assert report["seen"] == 60 and 0 < report["kept"] < 60, report
    assert (tmp_path / "clean" / "report.json").is_file()
