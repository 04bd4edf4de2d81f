"""`itde sample` from a checkpoint written by a run sharded over 8 devices (`[parallel]
fsdp = 8`: the checkpoint is the shards of the state) draws the same tokens in a process
that sees 8 devices as in one that sees 1.

8 virtual CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`, set before JAX
starts: each side runs in a fresh Python process)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TRAIN_AND_SAMPLE = """
import contextlib, io, json, sys
from pathlib import Path
import jax
import equinox as eqx
from itde.cli import main
from itde.train._internal import SHARDED
devices, out, train = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "train"
assert jax.device_count() == devices, jax.devices()
if train:
    toml = out.parent / "charlm.toml"
    toml.write_text('''
[task]
name = "charlm"
context = 16
[model]
n_layers = 2
n_features = 32
n_heads = 2
n_hidden = 64
[optim]
steps = 2
batch_size = 8
warmup = 0
[run]
log_every = 1
eval_every = 2
checkpoint_every = 2
progress = false
[parallel]
fsdp = 8
''')
    assert main(["train", "--config", str(toml), "--out", str(out), "--no-progress"]) == 0
texts = {}
for name, flags in (("greedy", ["--temperature", "0"]),
                    ("sampled", ["--temperature", "0.9", "--top-k", "8", "--seed", "7"])):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["sample", "--checkpoint", str(out), "--prompt", "the ", "--length",
                     "40", *flags]) == 0
    texts[name] = buf.getvalue()
from itde.train import load
model, cfg, meta = load(out)
print("RESULT " + json.dumps(dict(texts=texts, fsdp=cfg.parallel.fsdp,
                                  sharded=meta["format"] == SHARDED)))
"""


def _run(devices: int, out: Path, train: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "solvers"),
                                         env.get("PYTHONPATH", "")])  # fmt: skip
    env["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    if devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TRAIN_AND_SAMPLE), str(devices), str(out),
         "train" if train else "sample"],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
def test_itde_sample_from_a_sharded_checkpoint_draws_the_same_tokens_on_8_devices_and_1(
    tmp_path,
):
    """Trained with `fsdp = 8` on 8 devices, then sampled (greedy, and temperature 0.9 with
    top-k 8 and a seed) by `itde sample` there and in a one-device process: the same text.
    `itde sample` loads the model whole on one local device whatever the run's layout, so
    the draws (and the keys they use) cannot depend on how many devices the process sees."""
    out = tmp_path / "run"
    on8 = _run(8, out, train=True)
    on1 = _run(1, out, train=False)
    assert on8["fsdp"] == on1["fsdp"] == 8 and on8["sharded"], on8  # the shards' format
    for name in ("greedy", "sampled"):
        assert len(on8["texts"][name]) > len("the ") + 20, on8
        assert on8["texts"][name] == on1["texts"][name], (name, on8, on1)
    assert on8["texts"]["greedy"] != on8["texts"]["sampled"]
