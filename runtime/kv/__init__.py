"""KV cache bookkeeping (torch-free page pool) and storage."""
