"""`tessera bench serve`: an online serving benchmark against the tessera gRPC gateway or any
OpenAI-compatible HTTP server (fixed concurrency or Poisson arrivals), its metrics and plots."""
