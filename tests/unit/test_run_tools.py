"""tools/plot_runs.py and tools/compare_runs.py: on real tiny runs (two identical single-process runs and
a tp-2 run with another seed), and on hand-written metrics.jsonl files for the reading rules and the
one-line errors (exit status 2)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from megatron.run_metrics import RunError, format_steps, load_run, reading_note
from tests.functional.launch import TINY, parity_layouts, reference_runs

ROOT = Path(__file__).resolve().parents[2]
STEPS, GBS, SEQ = 10, 16, 32  # TINY's --max-steps, --global-batch-size, --max-seq-len


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


plot_runs = _tool("plot_runs")
compare_runs = _tool("compare_runs")


reference_runs({"tiny-again": TINY})
parity_layouts({"tp2-seed4321": (2, [*TINY, "--tp", "2", "--seed", "4321"])})
pytestmark = pytest.mark.shared_runs("tp2-seed4321")


@pytest.fixture(scope="module")
def runs(parity) -> dict[str, Path]:
    """Three real runs (shared): ``a`` and ``b`` with the same flags (bitwise equal on CPU), ``tp`` on two
    tensor-parallel ranks with another seed."""
    return {name: parity.outcome(run).check() for name, run in (("a", "tiny"), ("b", "tiny-again"),
                                                               ("tp", "tp2-seed4321"))}


def write_metrics(folder: Path, records: list[dict], tail: str = "", config: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (folder / "metrics.jsonl").write_text(text)
    if config:
        config_yaml = f"dataset: {{max_seq_len: {SEQ}}}\nbatch_size: {{global_batch_size: {GBS}}}\n"
        (folder / "config.yaml").write_text(config_yaml)
    return folder


def train(step: int, loss: float, grad_norm: float | None = 1.0, **extra) -> dict:
    return {"split": "train", "step": step, "loss": loss, "grad_norm": grad_norm, "learning_rate": 1e-3,
            "consumed_samples": step * GBS, **extra}


def one_line_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1, err
    return err


# Real runs


@pytest.mark.slow
def test_plot_png_draws_every_run_in_every_panel(runs, tmp_path, capsys):
    import matplotlib.image

    loaded = [load_run(str(runs[name])) for name in ("a", "b", "tp")]
    summary = plot_runs.plot(loaded, str(tmp_path / "runs.png"))
    assert summary.panels == ["training loss", "validation loss", "learning rate", "tokens/s (all ranks)",
                              "TFLOP/s per device", "gradient norm (before clipping)", "peak memory (GB)"]
    assert set(summary.lines.values()) == {3}  # on CPU: no MFU, no loss scale (fp32)
    assert summary.x_max == STEPS
    image = matplotlib.image.imread(tmp_path / "runs.png")
    assert image.shape[:2] == (summary.size[1], summary.size[0]) and summary.size[0] >= 1000
    assert image[..., :3].std() > 0.05  # not blank: axes, text and curves on white

    assert plot_runs.main([str(runs["a"]), str(runs["tp"] / "metrics.jsonl"), "-o", str(tmp_path / "two.png")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'two.png'}: 2 runs, 7 panels")


@pytest.mark.slow
def test_plot_svg_against_tokens(runs, tmp_path, capsys):
    output = tmp_path / "sub" / "runs.svg"
    assert plot_runs.main([str(runs["a"]), str(runs["tp"]), "-o", str(output), "--x", "tokens", "--smooth", "3",
                           "--labels", "tp 1,tp 2"]) == 0
    assert "2 runs, 7 panels" in capsys.readouterr().out
    svg = output.read_text()
    assert "<svg" in svg and "tp 1" in svg and "tp 2" in svg
    summary = plot_runs.plot([load_run(str(runs["a"]))], str(tmp_path / "t.svg"), x="tokens")
    assert summary.x_max == STEPS * GBS * SEQ  # consumed samples x max_seq_len of config.yaml


@pytest.mark.slow
def test_compare_identical_runs_assert_equal(runs, capsys):
    assert compare_runs.main([str(runs["a"]), str(runs["b"]), "--assert-equal", "--rtol", "0"]) == 0  # bitwise
    out = capsys.readouterr().out
    assert f"training steps in common: {STEPS} (1-{STEPS})" in out
    assert "valid loss at the 2 step(s) in common" in out and "all compared values agree" in out


@pytest.mark.slow
def test_compare_perturbed_tp2_run_differs(runs, capsys):
    assert compare_runs.main([str(runs["a"]), str(runs["tp"]), "--assert-equal"]) == 1
    captured = capsys.readouterr()
    assert "runs differ" in captured.err and "step 1: loss is" in captured.err  # another seed: from the first step
    assert f"loss [{runs['tp'].name} vs {runs['a'].name}]: largest relative gap" in captured.out  # named by folder
    assert compare_runs.main([str(runs["a"]), str(runs["tp"])]) == 0  # a report, not a check
    assert compare_runs.main([str(runs["a"]), str(runs["tp"]), "--assert-equal", "--rtol", "1"]) == 0


# Reading rules and the comparison, on hand-written files


def test_reading_is_lenient_and_the_later_record_wins(tmp_path):
    folder = write_metrics(tmp_path / "r", [train(1, 5.0), train(2, 4.0), "not a record", train(2, 3.5),
                                            {"split": "valid", "step": 2, "loss": 4.2},
                                            {"split": "future", "step": 2}],  # ignored, not unreadable
                           tail='{"split": "train", "step": 3, "lo')  # a killed run's partial last line
    run = load_run(str(folder))
    assert run.series("loss") == ([1, 2], [5.0, 3.5])
    assert (run.unreadable, run.replaced) == (1, 1)
    assert "skipped 1 unreadable line(s); 1 record(s) replaced" in reading_note(run)
    assert run.tokens([2]) == [2 * GBS * SEQ]
    assert run.label == "r"
    assert format_steps([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8"


def test_compare_reports_missing_steps_and_applies_the_tolerance(tmp_path, capsys):
    ref = write_metrics(tmp_path / "ref", [train(1, 2.0), train(2, 2.0), train(3, 2.0)])
    near = write_metrics(tmp_path / "near", [train(1, 2.0 + 2e-5), train(2, 2.0), train(4, 9.0)])
    args = [str(ref), str(near), "--assert-equal", "--metrics", "loss"]
    assert compare_runs.main(args) == 1  # 2e-5 > 0 + 1e-5 * 2: the default is 1e-5 relative
    captured = capsys.readouterr()
    assert "training steps in common: 2 (1-2)" in captured.out
    assert "ref lacks 1 of them: 4" in captured.out and "near lacks 1 of them: 3" in captured.out
    assert "step 1: loss is 2.00002 in near, 2 in ref" in captured.err
    assert compare_runs.main([*args, "--atol", "2e-5"]) == 0
    assert compare_runs.main([*args, "--rtol", "1e-4"]) == 0


def test_agreement_rule():
    agree = compare_runs.agree
    assert agree(1.0, 1.0, 0, 0) and agree(None, None, 0, 0) and agree(math.nan, math.nan, 0, 0)
    assert not agree(None, 1.0, 1, 1) and not agree(math.nan, 1.0, 1, 1) and not agree(math.inf, 1.0, 1, 1)
    assert agree(1.5, 1.0, 0.5, 0) and not agree(1.5, 1.0, 0.25, 0) and agree(0.5, 0.0, 0, 0.5)


def test_compare_null_grad_norm_against_a_number(tmp_path, capsys):
    """A step skipped in one run (grad_norm null) but not in the other is a difference."""
    ref = write_metrics(tmp_path / "ref", [train(1, 2.0), train(2, 2.0, grad_norm=None)])
    other = write_metrics(tmp_path / "other", [train(1, 2.0), train(2, 2.0, grad_norm=0.5)])
    assert compare_runs.main([str(ref), str(other), "--assert-equal"]) == 1
    assert "step 2: grad_norm is 0.5 in other, - in ref" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing", "empty", "no common step", "one run", "labels", "metric", "rtol"])
def test_compare_bad_input_is_one_line(tmp_path, capsys, case):
    ref = write_metrics(tmp_path / "ref", [train(1, 2.0), train(2, 2.0)])
    args = {
        "missing": [str(ref), str(tmp_path / "nowhere")],
        "empty": [str(ref), str(write_metrics(tmp_path / "empty", []))],
        "no common step": [str(ref), str(write_metrics(tmp_path / "late", [train(5, 1.0)]))],
        "one run": [str(ref)],
        "labels": [str(ref), str(ref), "--labels", "x"],
        "metric": [str(ref), str(ref), "--metrics", "loss,nonsense"],
        "rtol": [str(ref), str(ref), "--rtol", "-1"],
    }[case]
    assert compare_runs.main(args) == 2
    one_line_error(capsys, "compare_runs.py")


@pytest.mark.parametrize("case", ["missing", "empty", "extension", "smooth", "tokens without config"])
def test_plot_bad_input_is_one_line(tmp_path, capsys, case):
    ref = write_metrics(tmp_path / "ref", [train(1, 2.0), train(2, 1.5)])
    args = {
        "missing": [str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.png")],
        "empty": [str(write_metrics(tmp_path / "empty", [])), "-o", str(tmp_path / "x.png")],
        "extension": [str(ref), "-o", str(tmp_path / "x.jpg")],
        "smooth": [str(ref), "-o", str(tmp_path / "x.png"), "--smooth", "0"],
        "tokens without config": [str(write_metrics(tmp_path / "bare", [train(1, 2.0)], config=False)), "--x",
                                  "tokens", "-o", str(tmp_path / "x.png")],
    }[case]
    assert plot_runs.main(args) == 2
    one_line_error(capsys, "plot_runs.py")
    assert not (tmp_path / "x.png").exists()


def test_plot_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    ref = write_metrics(tmp_path / "ref", [train(1, 2.0)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plot_runs.main([str(ref), "-o", str(tmp_path / "x.png")]) == 2
    assert 'pip install -e ".[plot]"' in one_line_error(capsys, "plot_runs.py")


def test_plot_fp16_run_gets_mfu_and_loss_scale_panels(tmp_path):
    """A GPU fp16 run has MFU (instead of TFLOP/s) and a loss-scale panel; non-finite losses are gaps."""
    fp16 = write_metrics(tmp_path / "fp16", [train(s, math.nan if s == 2 else 3.0 - 0.1 * s, mfu=0.4, tflops=400.0,
                                                   loss_scale=2.0 ** (16 - s)) for s in range(1, 6)])
    summary = plot_runs.plot([load_run(str(fp16))], str(tmp_path / "fp16.png"), smooth=2)
    assert "MFU (%)" in summary.panels and "loss scale" in summary.panels
    assert "TFLOP/s per device" not in summary.panels and "validation loss" not in summary.panels
    assert plot_runs.trailing_mean([1.0, 3.0, math.inf, 5.0], 2) == [1.0, 2.0, math.inf, 5.0]


def test_plot_marks_where_a_run_resumed(tmp_path):
    """A resumed run's ``resume`` record (megatron/metrics.py writes it at the step the run continues from) is a
    dotted line in every panel and a "resumed" label; a run that never resumed gets none."""
    resumed = write_metrics(tmp_path / "run_a", [train(s, 3.0 - 0.1 * s) for s in range(1, 4)]
                            + [{"split": "resume", "step": 3, "dropped": 2, "time": 1.0}]
                            + [train(s, 3.0 - 0.1 * s) for s in range(4, 7)])
    fresh = write_metrics(tmp_path / "run_b", [train(s, 3.0 - 0.1 * s) for s in range(1, 7)])
    runs = [load_run(str(resumed)), load_run(str(fresh))]
    assert runs[0].resumes == [3] and runs[1].resumes == [] and runs[0].steps() == [1, 2, 3, 4, 5, 6]
    assert runs[0].unreadable == 0 and runs[0].replaced == 0
    summary = plot_runs.plot(runs, str(tmp_path / "runs.svg"))
    assert summary.resumes == {"run_a": [3.0]}
    svg = (tmp_path / "runs.svg").read_text()
    assert svg.count('id="resume-0-3"') == 1 and "resume-1-" not in svg  # the first panel's line
    assert svg.count("<!-- resumed -->") == 1  # the label (matplotlib draws text as paths, the string in a comment)
    assert plot_runs.plot(runs, str(tmp_path / "t.png"), x="tokens").resumes == {"run_a": [3.0 * GBS * SEQ]}


def test_run_error_names_the_folder(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(RunError, match="no metrics.jsonl in"):
        load_run(str(tmp_path / "run"))
