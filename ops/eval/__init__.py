"""Quality comparison harness: two serving configs of one model on the same text.

    python3 -m ops.eval --a kv_cache_dtype=bf16 --b kv_cache_dtype=fp8 --thresholds kl=0.05

See `ops/eval/cli.py` for what is measured and how the verdict is reached.
"""
