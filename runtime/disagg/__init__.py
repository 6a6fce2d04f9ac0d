"""Prefill/decode disaggregation: a request's KV moves from a prefill engine to a decode engine
as checksummed msgpack frames (`frames`), exported with logical positions (`export`) and
imported into pages reserved before any byte moves, in the decode engine's KV format, with
fresh generation tags, readable only once every frame is verified (`importer`)."""
