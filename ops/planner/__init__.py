"""Capacity planner: weights, KV bytes per token and KV capacity for a config.json, per device.

`tessera plan` (ops.planner.cli) for people and programs; ops.planner.engine for the running
engine. Torch-free.
"""
