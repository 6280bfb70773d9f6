"""parallel_config.compile=true trains the same model as eager mode, and its snapshots resume without compiling.

The compiled run uses gpt_config.attention=matmul (the fastest compiled setting on a CPU) against eager sdpa, so the
one compile this suite can afford also checks that both attention implementations train the same model, and that a
snapshot moves between them (attention is how the model computes, not its shape).
"""

from support import assert_ok, job_args, run_cli

from mingpt.reporting.logs import read_metrics


def compile_args(tmp_path, name: str, max_steps: int, *extra: str) -> list[str]:
    # dropout off: compiled kernels draw dropout masks from their own generator
    return job_args(tmp_path / f"snaps_{name}", tmp_path / f"run_{name}", "gpt_config.dropout=0.0", *extra,
                    max_steps=max_steps, log_every_steps=1)


def train_losses(run_dir) -> dict[int, float]:
    return {row["step"]: row["train_loss"] for row in read_metrics(run_dir) if "train_loss" in row}


def test_compiled_training_matches_eager_and_its_snapshot_resumes_eagerly(tmp_path):
    eager = run_cli(compile_args(tmp_path, "eager", 8), tmp_path)
    assert_ok(eager)
    compiled_args = compile_args(tmp_path, "compiled", 8, "parallel_config.compile=true", "gpt_config.attention=matmul")
    compiled = run_cli(compiled_args, tmp_path, timeout=600)
    assert_ok(compiled)

    expected, got = train_losses(tmp_path / "run_eager"), train_losses(tmp_path / "run_compiled")
    assert sorted(got) == sorted(expected) == list(range(1, 9))
    for step, loss in expected.items():  # fused kernels sum in another order: close, not bit-for-bit
        assert abs(got[step] - loss) < 1e-3 * loss, (step, got[step], loss)

    # The snapshot holds the plain module's weights (no torch.compile wrapper names, no attention mask buffer):
    # eager mode with sdpa attention continues it.
    resumed = run_cli(compile_args(tmp_path, "compiled", 12), tmp_path)
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert sorted(train_losses(tmp_path / "run_compiled")) == list(range(1, 13))
