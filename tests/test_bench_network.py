"""bench.network on the CPU: argument checks, and a smoke run on sims with torch on the CPU as the peer
(tiny ResNet-50 / MobileNet-v2 shapes)."""

from __future__ import annotations

import glob
import json

import pytest

torch = pytest.importorskip("torch")

from bench import network as N  # noqa: E402

SMALL = ["--devices", "sim:2", "--batch", "3", "--shrink", "16", "--size", "32", "--reps", "1", "--warmup", "0",
         "--quiet", "--chunk", "2"]


@pytest.mark.parametrize("argv, fragment", [
    (["--models", "vgg"], "--models"), (["--modes", "fp8"], "--modes"), (["--devices", "tpu:0"], "--devices"),
    (["--batch", "0"], "--batch"), (["--chunk", "0"], "--chunk"), (["--tag", "a b"], "--tag"),
    (["--devices", "cuda:"], "--devices"),
])
def test_bad_arguments_exit_with_the_option(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        N.parse_args(argv)
    assert fragment in capsys.readouterr().err


def test_help_mentions_the_smoke_run(capsys):
    with pytest.raises(SystemExit):
        N.parse_args(["--help"])
    assert "--devices sim:2" in capsys.readouterr().out


def test_smoke_run_on_sims_checks_every_output(tmp_path):
    rc = N.main([*SMALL, "--modes", "fp32", "--out", str(tmp_path)])
    data = json.loads(open(glob.glob(str(tmp_path / "network-*.json"))[0]).read())
    assert rc == 0 and data["ok"]
    names = [r["model"] for r in data["rows"]]
    assert names == ["resnet50", "mobilenet_v2"]
    for row in data["rows"]:
        assert [c["name"] for c in row["checks"]] == ["torch", "blasx compiled xsim:2", "blasx uncompiled xsim:2"]
        assert all(c["ok"] for c in row["checks"])
        compiled = row["runs"][1]
        assert compiled["images_per_s"] > 0 and compiled["nodes"] < row["runs"][2]["nodes"]
    md = open(glob.glob(str(tmp_path / "network-*.md"))[0]).read()
    assert "what fusion bought" in md and "top layers" in md
