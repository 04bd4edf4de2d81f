"""Progress of the long commands (`itde._progress.Stages`, `stage_line`,
`format_duration`): a line per stage from the first second, with an estimate of the whole,
in `itde converge` (the built-in problem and a model study) and `model_depth_study`."""

import io
import json
import re

import jax
import jax.numpy as jnp
import pytest
import torch

import itde
from itde._internal import Stages, estimate_line, format_duration, stage_line
from itde.cli import main
from itde.cli._internal import _model_study
from itde.studies import model_depth_study
from itde.studies._internal import _model_study as _model


class Clock:
    """A clock that the test moves."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.42, "0.42 s"), (3.25, "3.2 s"), (12.4, "12 s"), (125, "2 min 05 s"),
     (3599.6, "1 h 00 min"), (3780, "1 h 03 min")],
)  # fmt: skip
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_estimates_extrapolate_by_cost_and_count_compilation_apart():
    clock, out = Clock(), io.StringIO()
    st = Stages("study", 4, 100, file=out, clock=clock)
    rest = [(30, False), (40, True), (20, False)]
    with st.stage("a", 10, compiles=True, remaining=rest):  # 10 units in 8 s
        assert out.getvalue() == "study: [1/4] a ...\n"  # said before the work
        clock.t += 8
    # no stage without compilation yet: 8 s per 10 units over all 100 units
    assert out.getvalue().splitlines()[-1] == "study: [1/4] took 8.0 s; " + estimate_line(8, 80)
    with st.stage("b", 30, remaining=rest[1:]):  # 30 units in 3 s: 0.1 s a unit
        clock.t += 3
    # compiling costs 8 - 10 * 0.1 = 7 s; left: 40 units + a compilation, 20 units
    assert st.estimate(rest[1:]) == pytest.approx(11 + 4 + 7 + 2)
    assert out.getvalue().splitlines()[-1].endswith(estimate_line(11, 24))
    with st.stage("c", 40, compiles=True, remaining=rest[2:]):
        clock.t += 13  # a compilation of 9 s: the mean of both, 8 s, is the next one's
    assert st.estimate([(20, True)]) == pytest.approx(24 + 2 + 8)
    with st.stage("d", 20):
        clock.t += 2
    assert out.getvalue().splitlines()[-1] == "study: [4/4] took 2.0 s; done in 26 s"
    assert len(out.getvalue().splitlines()) == 8


def test_stages_and_durations_refuse_bad_values():
    with pytest.raises(ValueError, match=r"`n_stages`=0 must be a positive integer"):
        Stages("s", 0, 1.0)
    with pytest.raises(ValueError, match=r"`total_cost`=0 must be > 0"):
        Stages("s", 2, 0)
    st = Stages("s", 2, 10.0, enabled=False)
    with pytest.raises(ValueError, match=r"stage 'x': `cost`=-1 must be > 0"):
        st.stage("x", -1)
    with pytest.raises(ValueError, match=r"stage 'x': the stages cost more than `total_cost`"):
        st.stage("x", 11)
    with pytest.raises(ValueError, match=r"`seconds`=nan must be a finite duration"):
        format_duration(float("nan"))
    with pytest.raises(ValueError, match=r"`elapsed`=5 must be in \[0, `total`=4\]"):
        estimate_line(5, 4)
    out = io.StringIO()
    with stage_line("d", "w", enabled=False, file=out):
        pass
    assert out.getvalue() == ""


def _pre_norm_encoder():
    """A one-layer pre-norm encoder in float64: its continuum form is itself (two
    compilations in a study with one scheme)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, activation="gelu",
                                             batch_first=True, norm_first=True,
                                             dtype=torch.float64)  # fmt: skip
    return torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()


def test_model_study_says_each_stage_before_the_reference_finishes(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    seen = []  # what stderr held when each solve started and finished
    real = _model._final

    def spy(model, u0, mask, dt, name, max_steps, meter=None):
        seen.append(("start", name, err.getvalue()))
        y = real(model, u0, mask, dt, name, max_steps, meter)
        jax.block_until_ready(y)
        seen.append(("end", name, err.getvalue()))
        return y

    monkeypatch.setattr(_model, "_final", spy)
    m = itde.from_torch(_pre_norm_encoder())
    u0 = jax.random.normal(jax.random.key(0), (2, 5, 8), jnp.float64)
    r = model_depth_study(m, u0, schemes=("lie",), steps=(1, 2), reference_refinement=2)
    # the reference (Dopri8, 14 stages, 4 steps) is announced before it starts, with the
    # plan, and while it runs only its own bar speaks: a line per quarter (one a step),
    # all of them before the solve returns
    assert seen[0][:2] == ("start", "dopri8")
    lines = seen[0][2].splitlines()
    assert lines[0].startswith("model depth study: 5 solves of 2 inputs x 5 tokens")
    assert re.fullmatch(r"model depth study: \[1/5\] reference \(projected Dopri8, "
                        r"dt=0.25\), 4 steps \.\.\.", lines[1])  # fmt: skip
    during = seen[1][2][len(seen[0][2]) :].splitlines()
    assert [re.match(r"model depth study: \[1/5\] reference: +(\d+)% ", t).group(1)
            for t in during] == ["25", "50", "75", "100"], during  # fmt: skip
    # each with the whole study's estimate, from the reference's rate so far
    assert all(re.search(r", the study: about .+ in all\]$", t) for t in during), during
    text = [t for t in err.getvalue().splitlines() if "%" not in t]  # the stage lines
    assert re.fullmatch(r"model depth study: \[1/5\] took .+; about .+ in all, .+ left", text[2])
    assert [t.split("] ")[1] for t in text if t.endswith("...")] == [
        "reference (projected Dopri8, dt=0.25), 4 steps ...",
        "reference at 2 dt (its own error) (projected Dopri8, dt=0.5), 2 steps ...",
        "the network (Lie-Trotter splitting (the paper's sub-flows), dt=1), 1 steps ...",
        "lie, dt=1, 1 steps ...",
        "lie, dt=0.5, 2 steps ...",
    ]
    assert text[-1].startswith("model depth study: [5/5] took ") and "done in" in text[-1]
    assert len(text) == 11 and len(seen) == 10
    assert len(err.getvalue().splitlines()) == 11 + 4 + 2  # the check's bar: 2 steps
    # the errors are still each solve's distance to the reference
    assert r["results"][0]["errors"][0] == pytest.approx(r["network"]["distance_to_limit"])
    assert [s[1] for s in seen[::2]] == ["dopri8", "dopri8", "lie", "lie", "lie"]
    # progress=False: not a line, the bars inside the reference solves included (compiled)
    before = err.getvalue()
    model_depth_study(m, u0, schemes=("lie",), steps=(1, 2), reference_refinement=2,
                      progress=False)  # fmt: skip
    assert err.getvalue() == before and len(seen) == 20


CONVERGE_TINY = """\
[problem]
n_tokens = 4
n_features = 6
n_heads = 2
n_hidden = 8
[reference]
rtol = 1e-8
atol = 1e-8
[study]
schemes = ["lie"]
pre_norm_schemes = []
steps = [2, 4]
"""


def test_converge_says_the_reference_solve_first(tmp_path, capsys, monkeypatch):
    from itde.studies._internal import _depth

    def rows(model, u0, ref, *args):  # stop once the reference is solved (the rest: a bar)
        assert ref.shape == (4, 6)
        raise KeyboardInterrupt

    monkeypatch.setattr(_depth, "_scheme_rows", rows)
    cfg = tmp_path / "conv.toml"
    cfg.write_text(CONVERGE_TINY)
    assert main(["converge", "--config", str(cfg), "--out", str(tmp_path / "o")]) == 130
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("depth convergence: reference solve (projected Dopri8, adaptive, "
                      "rtol=1e-08, to T=1) ...")  # fmt: skip
    assert re.fullmatch(r"depth convergence: reference solve .* took [0-9.]+ s", err[1]), err
    assert "itde converge: error: interrupted" in err[2:]


def test_full_is_the_full_step_set_and_refuses_steps(tmp_path, capsys, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    got = []

    sizes = []  # (inputs, reference refinement) of each study

    def problem(directory, text, n):  # the model is not what this test is about
        sizes.append(n)
        return None, None, None, None, ("lie", None), "a model"

    def study(eq, u0, *, steps, reference_refinement, **kw):  # its arguments, not its work
        got.append(steps)
        sizes[-1] = (sizes[-1], reference_refinement)
        raise KeyboardInterrupt

    monkeypatch.setattr(_model_study, "_hf_problem", problem)
    monkeypatch.setattr(itde.studies, "model_depth_study", study)  # where the CLI reads it
    argv = ["converge", "--hf", str(tmp_path), "--out", str(tmp_path / "o")]
    assert main(argv) == 130 and main([*argv, "--full"]) == 130
    assert main([*argv, "--steps", "3", "5"]) == 130
    assert got == [(1, 2, 4, 8, 16), (1, 2, 4, 8, 16, 32), (3, 5)]
    assert got[:2] == [_model_study.DEFAULT_STEPS, _model_study.FULL_STEPS]
    # the default: 4 inputs, a reference 2x finer than 16 steps; --full: the full study
    assert sizes == [(4, 2), (8, 4), (4, 2)]
    assert main([*argv, "--full", "--inputs", "3"]) == 130 and sizes[-1] == (3, 4)
    del got[-1], sizes[-1]
    capsys.readouterr()
    assert main([*argv, "--full", "--steps", "1", "2"]) == 2
    assert ("`--full` and `--steps`=1 2: give one (--full is --steps 1 2 4 8 16 32)"
            in capsys.readouterr().err)  # fmt: skip
    assert main(["converge", "--full", "--out", str(tmp_path / "p")]) == 2
    assert "`--steps`/`--text`/`--full` are options of a model study" in capsys.readouterr().err
    assert len(got) == 3  # both refused before the study


def _tiny_bert(tmp_path):
    import transformers as tf

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "river", "is", "a"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    tok = tf.BertTokenizer(str(tmp_path / "vocab.txt"))
    config = tf.BertConfig(vocab_size=len(words), hidden_size=8, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=12,
                           max_position_embeddings=16)  # fmt: skip
    torch.manual_seed(0)
    tf.BertModel(config, add_pooling_layer=False).save_pretrained(tmp_path / "bert")
    tok.save_pretrained(tmp_path / "bert")
    text = tmp_path / "inputs.txt"
    text.write_text("the river is a river\nthe river\n")
    return tmp_path / "bert", text


@pytest.mark.slow
@pytest.mark.runs("converge --hf")
def test_full_study_runs_on_a_tiny_model(tmp_path, capsys):
    directory, text = _tiny_bert(tmp_path)
    out = tmp_path / "o"
    assert main(["converge", "--hf", str(directory), "--text", str(text), "--inputs", "2",
                 "--full", "--out", str(out)]) == 0  # fmt: skip
    r = json.loads((out / "convergence_model.json").read_text())
    assert r["results"][0]["dt"] == [1, 1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32]
    assert r["reference"]["dt"] == pytest.approx(1 / 128)
    err = capsys.readouterr().err
    assert "[1/21] reference" in err and "[21/21] took" in err


def test_gallery_stages_say_each_item_before_its_work(monkeypatch):
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "examples"))
    sys.modules.pop("_gallery", None)
    import _gallery

    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    seen = []
    for item in _gallery.each_stage("demo", ["a", "b", "c"], [1, 2, 3], ["A", "B", "C"],
                                    [True, False, False]):  # fmt: skip
        seen.append((item, err.getvalue().splitlines()[-1]))
    assert seen == [("a", "demo: [1/3] A ..."), ("b", "demo: [2/3] B ..."),
                    ("c", "demo: [3/3] C ...")]  # fmt: skip
    lines = err.getvalue().splitlines()
    assert re.fullmatch(r"demo: \[1/3\] took .+; about .+ in all, .+ left", lines[1])
    assert lines[-1].startswith("demo: [3/3] took ") and len(lines) == 6
    with pytest.raises(ValueError, match=r"stage 'B': `cost`=0 must be > 0"):
        list(_gallery.each_stage("demo", ["a", "b"], [1, 0], ["A", "B"]))


def test_order_check_says_whether_a_slope_is_an_order():
    from itde.studies._internal import order_check

    dts = [1.0, 0.5, 0.25, 0.125]
    settled = order_check(dts, [4.0 * h**2 * (1 + 0.01 * h) for h in dts])
    assert settled["verdict"] == "settled" and abs(settled["slope"] - 2) < 0.01
    # errors that bend: slopes 1, 2, 3 (still changing by 1 at the finest pair)
    bent = order_check(dts, [1.0, 0.5, 0.125, 0.015625])
    assert bent["verdict"] == "pre-asymptotic"
    assert bent["slope"] == pytest.approx(3) and bent["previous"] == pytest.approx(2)
    assert bent["change"] == pytest.approx(1)
    # the slope moves by 0.15 (settled) or by 0.3 (not) at the default tolerance 0.2
    for step, verdict in ((0.15, "settled"), (0.3, "pre-asymptotic")):
        e = [1.0, 0.5**2, 0.5 ** (2 + 2 + step)]
        assert order_check(dts[:3], e)["verdict"] == verdict
    assert order_check(dts[:2], [1.0, 0.25])["verdict"] == "undetermined"
    # the finest error within 10x of the reference's own: no order to read
    ref = order_check(dts, [1.0, 0.25, 1 / 16, 1 / 64], reference_error=1 / 640 + 1e-9)
    assert ref["verdict"] == "reference-limited"
    # round-off points are left out before the pairs are formed
    assert order_check(dts, [1.0, 0.25, 1 / 16, 1e-15])["verdict"] == "settled"


@pytest.mark.slow  # two studies of a tiny BERT: about a minute on 2 busy cores
@pytest.mark.runs("converge --hf")
def test_reference_bar_comes_before_the_result_and_no_progress_silences_it(
    tmp_path, capsys, monkeypatch
):  # fmt: skip
    directory, text = _tiny_bert(tmp_path)
    real, said = _model._final, []

    def spy(model, u0, mask, dt, name, max_steps, meter=None):
        y = jax.block_until_ready(real(model, u0, mask, dt, name, max_steps, meter))
        said.append((name, capsys.readouterr()))  # what was printed when this solve returned
        return y

    monkeypatch.setattr(_model, "_final", spy)
    argv = ["converge", "--hf", str(directory), "--text", str(text), "--inputs", "2",
            "--steps", "1", "2", "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 0
    name, first = said[0]
    assert name == "dopri8" and first.out == ""  # nothing of the result yet
    # the reference (1 layer at 2 x 2 steps: dt 1/4) drew its bar while it ran: a line a step
    bar = re.findall(r"\[1/9\] reference: +(\d+)% ", first.err)
    assert bar == ["25", "50", "75", "100"], first.err
    assert first.err.index("[1/9] reference (projected Dopri8") < first.err.index("25%")
    rest = capsys.readouterr().out
    assert "PRE-ASYMPTOTIC" in rest or "settled" in rest or "UNDETERMINED" in rest
    assert "UNDETERMINED: one pair only" in rest and "run with --full" in rest
    said.clear()
    assert main([*argv, "--no-progress"]) == 0
    # (transformers' own "Loading weights" bar is not the study's)
    assert all("model depth study" not in c.err for _, c in said), [c.err for _, c in said]
    assert "model depth study" not in capsys.readouterr().err
    assert len(said) == 9


def test_grid_study_says_its_plan_and_each_reference_first(tmp_path, capsys, monkeypatch):
    from itde.studies._internal import _grid

    def stop(rule, n):  # stop once the first reference is solved: the rest is the bar's
        raise KeyboardInterrupt

    monkeypatch.setattr(_grid, "_nodes_for", stop)
    # the lines, not the solves: each functional (a compilation) is replaced by a number
    monkeypatch.setattr(_grid.GridProblem, "functional", lambda self, grid, n, fn: 0.5)
    cfg = tmp_path / "grid.toml"
    cfg.write_text("[study]\nnodes = [4, 8]\nreference_nodes = 12\nrules = ['midpoint']\n"
                   "layers = 1\nmodes = 2\n")  # fmt: skip
    assert main(["converge", "--axis", "features", "--config", str(cfg),
                 "--out", str(tmp_path / "o")]) == 130  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("features convergence: 1 rows (midpoint) x 2 grids of 4, 8 nodes")
    assert err[1] == "features convergence: reference: 12 Gauss-Legendre nodes ..."
    assert re.fullmatch(r"features convergence: reference: 12 Gauss-Legendre nodes took .+",
                        err[2])  # fmt: skip
