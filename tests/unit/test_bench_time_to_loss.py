"""benchmarks/time_to_loss.py in this process: the settings it sets itself are refused (its readers of both
programs' output and the whole runs: tests/e2e/test_bench_time_to_loss.py). Not a performance test."""

from __future__ import annotations

from benchmarks import time_to_loss


def test_the_settings_it_sets_itself_are_refused(capsys, tmp_path):
    code = time_to_loss.main(["--nanogpt", str(tmp_path), "preset=cpu", "trainer_config.eval_every_steps=10"])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: trainer_config.eval_every_steps is set by this script")
    assert time_to_loss.main(["--nanogpt", str(tmp_path), "preset=cpu"]) == 2
    assert capsys.readouterr().err.strip() == f"error: no train.py in {tmp_path}"
