"""Proto <-> domain conversion, used only at the edges (the worker's servicer, the SDK)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import worker_pb2 as wpb
from runtime.errors import ContextLengthExceeded, InvalidArgument, bounded
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.step_times import EngineTimes, StepTotals
from runtime.structured_output import StructuredOutput

# The metadata key (gRPC) and header (HTTP) that pins a client's requests to one worker.
SESSION_HEADER = "x-session-affinity"
MAX_NAME_BYTES = 256  # model ids and session ids, refused past this at the edge

MAX_WIRE_TOKENS = 2**32 - 1  # SamplingOptions.max_tokens is a uint32
_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                    "n", "logprobs", "min_tokens")


@dataclass(frozen=True)
class ServedInfo:
    """What a worker serves: reported in every final message."""

    model: str
    revision: str
    prefill_weights: str
    prefill_kv_cache: str
    decode_weights: str
    decode_kv_cache: str
    worker_id: str

    def to_proto(self) -> pb.ServedConfig:
        return pb.ServedConfig(
            model=self.model, revision=self.revision, worker_id=self.worker_id,
            prefill=pb.PhaseFormat(weights=self.prefill_weights, kv_cache=self.prefill_kv_cache),
            decode=pb.PhaseFormat(weights=self.decode_weights, kv_cache=self.decode_kv_cache))

    @classmethod
    def from_proto(cls, s: pb.ServedConfig) -> ServedInfo:
        return cls(s.model, s.revision, s.prefill.weights, s.prefill.kv_cache, s.decode.weights,
                   s.decode.kv_cache, s.worker_id)


def sampling_params(opts: pb.SamplingOptions) -> SamplingParams:
    """An unset field takes SamplingParams' default, but an unset max_tokens means all the
    context leaves (the offline default of 16 is for offline calls)."""
    kwargs: dict[str, Any] = {name: getattr(opts, name) for name in _OPTIONAL_FIELDS
                              if opts.HasField(name)}
    kwargs.setdefault("max_tokens", None)
    if kwargs["max_tokens"] == 0:
        raise InvalidArgument("max_tokens must be at least 1, got 0", field="max_tokens")
    if opts.HasField("structured_output"):
        kwargs["structured_output"] = structured_output(opts.structured_output)
    return SamplingParams(stop=tuple(opts.stop), stop_token_ids=tuple(opts.stop_token_ids),
                          ignore_eos=opts.ignore_eos, **kwargs)


def structured_output(msg: pb.StructuredOutput) -> StructuredOutput:
    """The wire's oneof to the domain value (which checks size and nesting)."""
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        raise InvalidArgument("structured_output names no kind", field="structured_output")
    return StructuredOutput(kind, "" if kind == "json_object" else getattr(msg, kind))


def structured_output_message(so: StructuredOutput) -> pb.StructuredOutput:
    if so.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    return pb.StructuredOutput(**{so.kind: so.spec})


def sampling_options(**kwargs: Any) -> pb.SamplingOptions:
    """SDK side: keyword sampling arguments (None = engine default) to the wire message."""
    unknown = set(kwargs) - {*_OPTIONAL_FIELDS, "stop", "stop_token_ids", "ignore_eos",
                             "structured_output"}
    if unknown:
        raise TypeError(f"unknown sampling options: {sorted(unknown)}")
    fields = {k: v for k, v in kwargs.items() if v is not None}
    if "structured_output" in fields:
        fields["structured_output"] = structured_output_message(fields["structured_output"])
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    max_tokens = fields.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) \
            and max_tokens > MAX_WIRE_TOKENS:
        # NOTE: the same class the engine gives a max_tokens past the context: an input's error
        # class never depends on its size.
        raise ContextLengthExceeded(
            f"max_tokens is more than any model's context (the wire carries at most "
            f"{MAX_WIRE_TOKENS}); ask for fewer tokens, or leave it out for all the context "
            f"leaves after the prompt", field="max_tokens")
    return build_message(pb.SamplingOptions, fields)


def build_message(cls: Any, fields: dict[str, Any]) -> Any:
    """SDK side: `cls(**fields)`, a value the wire type cannot hold (a negative or too large
    integer, a wrong type) raising InvalidArgument naming its field, as the server would."""
    try:
        return cls(**fields)
    except (TypeError, ValueError):
        pass
    for name, value in fields.items():
        try:
            cls(**{name: value})
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"{name}: {_wire_error(cls, name, value, e)}",
                                  field=name) from None
    return cls(**fields)  # NOTE: only a combination failed; let protobuf say why


def _wire_error(cls: Any, name: str, value: Any, error: Exception) -> str:
    field = cls.DESCRIPTOR.fields_by_name.get(name)
    bounds = {field.TYPE_UINT32: (0, 2**32 - 1), field.TYPE_UINT64: (0, 2**64 - 1),
              field.TYPE_INT32: (-(2**31), 2**31 - 1), field.TYPE_INT64: (-(2**63), 2**63 - 1),
              } if field is not None else {}
    if field is not None and field.type in bounds and isinstance(value, int) \
            and not isinstance(value, bool):
        low, high = bounds[field.type]
        return f"must be an integer from {low} to {high}"  # NOTE: never echoes the value
    return bounded(str(error), 200)


def message_dict(m: pb.ChatMessage) -> dict[str, str]:
    """A chat message for the chat template: role and content, and tool_call_id / name when
    set (templates with a tool format read them; others ignore them)."""
    msg = {"role": m.role, "content": m.content}
    if m.tool_call_id:
        msg["tool_call_id"] = m.tool_call_id
    if m.name:
        msg["name"] = m.name
    return msg


def chat_message(message: dict[str, str]) -> pb.ChatMessage:
    """SDK side: a message dict (role, content, optional tool_call_id and name) to the wire."""
    return build_message(pb.ChatMessage, {
        "role": message["role"], "content": message["content"],
        "tool_call_id": message.get("tool_call_id") or "", "name": message.get("name") or ""})


def chunk_response(out: RequestOutput, first: bool = False, served: ServedInfo | None = None,
                   index: int = 0,
                   logprobs: list[pb.TokenLogprob] | None = None) -> pb.GenerateResponse | None:
    """The chunk for one candidate's output, or None when it adds nothing. A request's first
    chunk carries its prompt and cached token counts (so a stream cut short is still billed for
    them) and the served configuration (so every chunk a client relays can name the model);
    a candidate's last chunk, why it ended."""
    if not out.delta_text and not out.delta_token_ids and not out.finished:
        return None
    chunk = pb.Chunk(text=out.delta_text, token_ids=out.delta_token_ids, index=index,
                     logprobs=logprobs or ())
    if out.finished:
        completion = out.outputs[0]
        chunk.finish_reason = completion.finish_reason or ""
        chunk.stop_reason = "" if completion.stop_reason is None else str(completion.stop_reason)
    if first:
        chunk.usage.CopyFrom(pb.Usage(prompt_tokens=len(out.prompt_token_ids),
                                      cached_tokens=out.num_cached_tokens))
        if served is not None:
            chunk.served.CopyFrom(served.to_proto())
    return pb.GenerateResponse(chunk=chunk)


def final_response(outs: list[RequestOutput], served: ServedInfo) -> pb.GenerateResponse:
    """The one final message for every candidate's last output (by index): the prompt counted
    once, cached tokens as candidate 0 found them, completion tokens of all candidates."""
    ends = []
    for i, out in enumerate(outs):
        c = out.outputs[0]
        ends.append(pb.CandidateEnd(index=i, finish_reason=c.finish_reason or "",
                                    stop_reason="" if c.stop_reason is None else str(c.stop_reason),
                                    completion_tokens=len(c.token_ids),
                                    cached_tokens=out.num_cached_tokens))
    first = outs[0]
    usage = pb.Usage(prompt_tokens=len(first.prompt_token_ids),
                     cached_tokens=first.num_cached_tokens,
                     completion_tokens=sum(e.completion_tokens for e in ends))
    return pb.GenerateResponse(final=pb.Final(finish_reason=ends[0].finish_reason,
                                              stop_reason=ends[0].stop_reason, usage=usage,
                                              served=served.to_proto(), candidates=ends))


def engine_times(times: EngineTimes) -> wpb.EngineTimes:
    """An engine's time totals (runtime/step_times.py) as the worker's Status reports them."""
    def totals(t: StepTotals) -> wpb.StepTotals:
        return wpb.StepTotals(steps=t.steps, wall_s=t.wall_s, compute_s=t.compute_s,
                              decode_rows=t.decode_rows, prefill_tokens=t.prefill_tokens)

    return wpb.EngineTimes(decode=totals(times.decode), mixed=totals(times.mixed),
                           commands_s=times.commands_s, publish_s=times.publish_s,
                           idle_s=times.idle_s, loop_cpu_s=times.loop_cpu_s)
