"""bench.py's parts in this process: the nanoGPT baseline keeps nanoGPT's attention (the runs themselves:
tests/e2e/test_bench.py; neither is a performance test)."""




def test_nanogpt_baseline_keeps_nanogpts_attention():
    """The reference loop is nanoGPT's: torch's sdpa attention even when ours is told to use matmul attention."""
    from benchmarks import bench
    from char_dataset import CharCorpus
    from main import load_config
    from model import CausalSelfAttention

    cfg = load_config(["preset=nanogpt_cpu", "gpt_config.attention=matmul", "data_config.truncate=0.05"])
    loop = bench.NanoGPTLoop(cfg, CharCorpus.load(cfg.data_config))
    attentions = {m.attention for m in loop.model.modules() if isinstance(m, CausalSelfAttention)}
    assert attentions == {"sdpa"}
