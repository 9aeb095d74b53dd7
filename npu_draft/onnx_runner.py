"""Backend `onnx`: a plain ONNX decoder graph with past/present KV, run through IO binding.

Each session's cache (a slot, `npu_draft.kv_slots`) is ONE buffer per layer for keys
and one for values, shaped [1, kv_heads, max_context, head_dim], bound as both
`past_key_values.N.*` and `present.N.*`. GroupQueryAttention (com.microsoft) writes
the new positions in place and reads only as many as the attention mask holds ones, so
the cache never moves: rolling back is just a shorter attention mask, and re-sync
costs only the new tokens.
(Copying the cache every step doubled the per-token time; docs/BENCHMARKS.md.)

Graphs from `onnxruntime_genai.models.builder` (what `npu-spec export-drafter`
writes) have this shape; a graph whose attention concatenates past and present
(optimum's default export) cannot share the buffer and is refused with a hint.

On CUDA one-token steps replay as CUDA graphs (`npu_draft.decode_graph`); prompts run
in chunks of varying shape, uncaptured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from npu_draft import providers
from npu_draft.decode_graph import DecodeGraph, run_options
from npu_draft.kv_slots import KvSlot, SlotPool
from npu_draft.ort_backend import (
    DEFAULT_MAX_CONTEXT,
    OrtDraftModel,
    OrtDraftSession,
    session_context,
)
from npu_draft.protocol import (
    GREEDY,
    CancelToken,
    Draft,
    SamplingParams,
    SyncStats,
    common_prefix_length,
)
from npu_draft.sampling import draft_next
from npu_draft.tokenizer_check import DrafterManifest

log = logging.getLogger(__name__)

# Prefill runs in chunks. A graph that emits logits for every input position would
# otherwise make a 2.5 GB tensor at 4k positions x 152k vocabulary; one trimmed to
# the last position (what export-drafter writes) only bounds attention scratch.
PREFILL_CHUNK = 128
PREFILL_CHUNK_LAST_POSITION = 512

_ORT_FLOAT = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
# the load-time check's one-token steps: the first of an id runs plain and captures,
# the rest replay
_GRAPH_CHECK_STEPS = 6
# With CUDA graphs, one device call at a time in the whole process (every model, a
# reloaded one beside the one it replaces): a capture fails when another thread
# allocates or synchronises, and a replay writes the intermediate buffers it was
# captured with, which the arena lends to any other run meanwhile.
_DEVICE_LOCK = threading.Lock()


@dataclass(frozen=True)
class DecoderSpec:
    """Shapes and names the runner needs, from genai_config.json or npu_draft.json."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    filename: str = "model.onnx"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"

    @classmethod
    def from_folder(cls, folder: Path) -> DecoderSpec:
        genai_config = folder / "genai_config.json"
        if genai_config.exists():
            return cls._from_genai_config(json.loads(genai_config.read_text())["model"])
        manifest = DrafterManifest.read(folder)
        if manifest is not None and manifest.decoder:
            known = set(cls.__dataclass_fields__)
            fields = {k: v for k, v in manifest.decoder.items() if k in known}
            fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
            return cls(**fields)
        raise FileNotFoundError(
            f"{folder}: no genai_config.json or npu_draft.json describing the decoder "
            f"(layers, KV heads, head size); export it with `npu-spec export-drafter`"
        )

    @classmethod
    def _from_genai_config(cls, model: dict) -> DecoderSpec:
        decoder = model["decoder"]
        inputs, outputs = decoder.get("inputs", {}), decoder.get("outputs", {})
        eos = model.get("eos_token_id", [])
        return cls(
            num_layers=decoder["num_hidden_layers"],
            num_kv_heads=decoder["num_key_value_heads"],
            head_dim=decoder["head_size"],
            vocab_size=model["vocab_size"],
            context_length=model.get("context_length", DEFAULT_MAX_CONTEXT),
            filename=decoder.get("filename", "model.onnx"),
            bos_token_id=model.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
            past_key=inputs.get("past_key_names", cls.past_key),
            past_value=inputs.get("past_value_names", cls.past_value),
            present_key=outputs.get("present_key_names", cls.present_key),
            present_value=outputs.get("present_value_names", cls.present_value),
        )

    def to_json(self) -> dict:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["eos_token_ids"] = list(self.eos_token_ids)
        return data


class OnnxDraftModel(OrtDraftModel):
    """A loaded ONNX decoder; `open_session()` gives each conversation its own cache."""

    backend = "onnx"

    def __init__(
        self,
        folder: str | Path,
        provider: str = "auto",
        *,
        max_context: int | None = None,
        threads: int | None = None,
        cross_check: bool | None = None,
        config_file: str | None = None,
        cache_dir: str | None = None,
        cache_key: str | None = None,
        prefill_chunk: int | None = None,
        profile_prefix: str | None = None,
        cuda_graphs: bool | None = None,
    ) -> None:
        """`cuda_graphs`: one-token steps replayed as CUDA graphs (`npu_draft.decode_graph`);
        None: on CUDA. Graphs that fail or disagree with plain steps at load are turned
        off with a warning. True on the CPU runs the same fixed-buffer steps uncaptured."""
        self.folder = Path(folder)
        self.spec = DecoderSpec.from_folder(self.folder)
        fp32_cache = _require_shared_buffer_attention(self.folder / self.spec.filename, self.spec)
        self.max_context = session_context(self.folder, max_context, self.spec.context_length)
        self.choice = _attention_provider(
            providers.choose_provider(
                provider, config_file=config_file, cache_dir=cache_dir, cache_key=cache_key
            ),
            provider,
            fp32_cache,
            self.folder,
        )
        self._threads, self._profile_prefix = threads, profile_prefix
        self.profile_path: Path | None = None  # the profile's file, once `close` wrote it
        graphs = cuda_graphs if cuda_graphs is not None else self.choice.name == "cuda"
        try:
            logits = self._load(graphs)
        except Exception:  # ORT refuses capture where nodes are off the GPU
            if not (graphs and self.choice.name == "cuda"):
                raise
            log.warning("no CUDA graph steps for this graph; drafting without", exc_info=True)
            logits = self._load(False)
        last_position_only = len(logits.shape) == 3 and logits.shape[1] == 1
        self.prefill_chunk = prefill_chunk or (
            PREFILL_CHUNK_LAST_POSITION if last_position_only else PREFILL_CHUNK
        )
        if self.graphs and self.choice.name == "cuda" and not self._decode_graphs_agree():
            self._load(False)
        # On CUDA a prompt's first chunks deep into the context load kernels of their own
        # (1.0-1.1 s for a first 4,000-token prompt on an H100 after a one-chunk warm-up):
        # warm up over the whole context there (`npu_draft.warmup`), ~1 s at load
        self.warm_up_length = self.max_context if self.choice.name == "cuda" else 0
        self._describe_and_check(
            vocab_size=self.spec.vocab_size,
            eos_token_ids=self.spec.eos_token_ids,
            bos_token_id=self.spec.bos_token_id,
            cross_check=cross_check,
            runs_on=f"{self.choice.name} ({self.choice.ort_name})",
        )

    def _load(self, graphs: bool) -> Any:
        """Create the ONNX Runtime session (with CUDA graphs where `graphs` and on CUDA)
        and the slot pool; returns the logits output's description."""
        options = ort.SessionOptions()
        options.intra_op_num_threads = self._threads or providers.default_threads()
        options.log_severity_level = 3  # ORT's warnings about unused initializers are noise
        if self._profile_prefix:  # per-node timings (scripts/drafter_profile.py)
            options.enable_profiling = True
            options.profile_file_prefix = self._profile_prefix
        choice = self.choice
        if graphs and choice.name == "cuda":
            choice = dataclasses.replace(
                choice, options={**choice.options, "enable_cuda_graph": "1"}
            )
        with _DEVICE_LOCK if choice.name == "cuda" else contextlib.nullcontext():
            self.session = ort.InferenceSession(
                str(self.folder / self.spec.filename), options, providers=choice.ort_providers()
            )
        providers.check_session_providers(self.choice, self.session.get_providers())
        self._inputs = {i.name: i for i in self.session.get_inputs()}
        self._kv_dtype = _ORT_FLOAT[self._inputs[self.spec.past_key % 0].type]
        logits = next(o for o in self.session.get_outputs() if o.name == "logits")
        self.graphs = graphs and len(logits.shape) == 3
        self._logits_dtype = _ORT_FLOAT[logits.type]
        self._run_lock: Any = (
            _DEVICE_LOCK if self.graphs or self.choice.name == "cuda" else contextlib.nullcontext()
        )
        self._chunk_options = run_options(-1) if self.graphs else None
        model = weakref.ref(self)  # the pool must not keep its model alive (a reload frees it)
        self._slots = SlotPool(lambda graphed: model()._new_slot(graphed), keep=self.graphs)
        self._graph_ids = itertools.count(1)  # never reused: a captured graph cannot be dropped
        return logits

    def _new_slot(self, graphed: bool) -> KvSlot:
        with self._run_lock:  # allocating on the device breaks another thread's capture
            return self._allocate_slot(graphed)

    def _allocate_slot(self, graphed: bool) -> KvSlot:
        spec = self.spec
        shape = (1, spec.num_kv_heads, self.max_context, spec.head_dim)
        # The cache lives where the provider computes: a CPU buffer bound to a CUDA
        # session would be copied in and out every step, and GQA only shares a
        # buffer it can write in place. The NPU provider works on host memory.
        if self.choice.name == "cuda":
            cache = [
                ort.OrtValue.ortvalue_from_shape_and_type(shape, self._kv_dtype, "cuda", 0)
                for _ in range(2 * spec.num_layers)
            ]
        else:
            cache = [
                ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self._kv_dtype))
                for _ in range(2 * spec.num_layers)
            ]

        def bind_cache(binding: ort.IOBinding) -> None:
            for layer in range(spec.num_layers):
                for name_in, name_out, value in (
                    (spec.past_key, spec.present_key, cache[2 * layer]),
                    (spec.past_value, spec.present_value, cache[2 * layer + 1]),
                ):
                    binding.bind_ortvalue_input(name_in % layer, value)
                    binding.bind_ortvalue_output(name_out % layer, value)

        binding = self.session.io_binding()
        bind_cache(binding)
        slot = KvSlot(cache, binding)
        if graphed and self.graphs:
            slot.graph = DecodeGraph(
                self.session,
                bind_cache,
                graph_id=next(self._graph_ids),
                device="cuda" if self.choice.name == "cuda" else "cpu",
                max_context=self.max_context,
                vocab_size=spec.vocab_size,
                logits_dtype=self._logits_dtype,
                has_position_ids="position_ids" in self._inputs,
            )
        return slot

    def _decode_graphs_agree(self) -> bool:
        """Whether graphed steps run and match plain ones on the probe sequence, the
        capture's step and replays after it."""
        graphed, plain = OnnxDraftSession(self), OnnxDraftSession(self, graphed=False)
        try:
            prompt = providers.probe_tokens(self.spec.vocab_size)
            for _ in range(_GRAPH_CHECK_STEPS):
                graphed.sync(prompt)
                plain.sync(prompt)
                expected, got = plain.next_logits(), graphed.next_logits()
                if not np.allclose(
                    got, expected, atol=providers.CROSS_CHECK_ATOL, rtol=providers.CROSS_CHECK_RTOL
                ):
                    worst = float(np.max(np.abs(got - expected)))
                    log.warning("CUDA graph steps differ from plain ones by %.3g: off", worst)
                    return False
                prompt = [*prompt, int(np.argmax(expected))]
            return True
        except Exception:  # a provider that cannot capture this graph: plain steps
            log.warning("CUDA graph steps failed; drafting without them", exc_info=True)
            return False
        finally:
            graphed.close()
            plain.close()

    def open_session(self) -> OnnxDraftSession:
        return OnnxDraftSession(self)

    def _cpu_reference_options(self) -> dict[str, Any]:
        return {"prefill_chunk": self.prefill_chunk}

    def close(self) -> None:
        if self.session is not None and self.session.get_session_options().enable_profiling:
            self.profile_path = Path(self.session.end_profiling())
        self._slots.clear()
        self.session = None  # type: ignore[assignment]


class OnnxDraftSession(OrtDraftSession):
    """One token sequence's KV cache: a slot of the model's (`npu_draft.kv_slots`), taken
    at the first run, on the thread that runs the session."""

    def __init__(self, model: OnnxDraftModel, *, graphed: bool = True) -> None:
        super().__init__()
        self._model = model
        self._graphed = graphed
        self._slot: KvSlot | None = None
        self._give_back: weakref.finalize | None = None
        self._closed = False
        self._mask = np.ones((1, model.max_context), dtype=np.int64)
        self._has_position_ids = "position_ids" in model._inputs

    def sync(self, tokens: Sequence[int]) -> SyncStats:
        tokens = self._fitting(tokens, self._model.max_context)
        keep = common_prefix_length(self._cached, tokens)
        if keep == len(tokens) and keep < len(self._cached):
            keep -= 1  # pure rollback: re-run the last token to get its logits back
        self._pending = []
        if keep == len(tokens) == len(self._cached):
            return SyncStats(reused=keep, appended=0)
        keep = max(keep, 0)
        return self._keep_and_feed(tokens, keep)

    def propose(
        self,
        k: int,
        sampling: SamplingParams = GREEDY,
        rng: np.random.Generator | None = None,
        cancel: CancelToken | None = None,
    ) -> Draft:
        if self._pending:  # drafting again without a sync: continue after the last draft
            self._feed(self._pending)
            self._pending = []
        draft = Draft(dists=None if sampling.greedy else [])
        room = self._model.max_context - len(self._cached)
        for i in range(min(k, room)):
            if cancel is not None and cancel.cancelled:
                break
            if i > 0:  # the previous draft token enters the cache only when needed
                self._feed(self._pending)
                self._pending = []
            token = draft_next(draft, self.next_logits(), sampling, rng)
            self._pending = [token]
        return draft

    def _feed(self, new_tokens: Sequence[int]) -> None:
        if self._closed:
            raise RuntimeError("draft session used after close")
        if self._slot is None:
            pool = self._model._slots
            self._slot = pool.take(self._graphed)
            # a session dropped without close hands its slot back when collected
            self._give_back = weakref.finalize(self, pool.give_back, self._slot)
            self._give_back.atexit = False
        graph = self._slot.graph
        if graph is not None and len(new_tokens) == 1:
            with self._model._run_lock:
                self._logits = graph.step(new_tokens[0], len(self._cached))
            self._cached.append(new_tokens[0])
            return
        chunk = self._model.prefill_chunk
        for start in range(0, len(new_tokens), chunk):
            piece = list(new_tokens[start : start + chunk])
            self._logits = self._forward(piece, len(self._cached))
            self._cached.extend(piece)

    def _forward(self, piece: list[int], past_length: int) -> np.ndarray:
        total = past_length + len(piece)
        model = self._model
        binding = self._slot.binding  # type: ignore[union-attr]  # taken by _feed
        binding.bind_cpu_input("input_ids", np.array([piece], dtype=np.int64))
        binding.bind_cpu_input("attention_mask", self._mask[:, :total])
        if self._has_position_ids:
            positions = np.arange(past_length, total, dtype=np.int64)[None, :]
            binding.bind_cpu_input("position_ids", positions)
        binding.bind_output("logits", "cpu")
        with model._run_lock:
            model.session.run_with_iobinding(binding, model._chunk_options)
            logits = binding.get_outputs()[-1].numpy()
        return np.asarray(logits[0, -1], dtype=np.float32)

    def close(self) -> None:
        self._closed = True
        self._cached, self._pending, self._logits = [], [], None
        self._slot = None
        if self._give_back is not None:
            self._give_back()  # once: the finalizer runs at most one time


def _require_shared_buffer_attention(model_path: Path, spec: DecoderSpec) -> bool:
    """Refuse graphs whose past keys feed something other than GroupQueryAttention;
    return whether the past keys are fp32."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    past = spec.past_key % 0
    kv_type = next((i.type.tensor_type.elem_type for i in graph.input if i.name == past), None)
    fp32_cache = kv_type == onnx.TensorProto.FLOAT
    consumers = {node.op_type for node in graph.node if past in node.input}
    if consumers and consumers != {"GroupQueryAttention"}:
        raise ValueError(
            f"{model_path}: past keys feed {sorted(consumers)}, not GroupQueryAttention, so "
            f"past and present cannot share one buffer; re-export with "
            f"`npu-spec export-drafter HF_DIR OUT --format onnx`"
        )
    return fp32_cache


def _attention_provider(
    choice: providers.ProviderChoice, requested: str, fp32_cache: bool, folder: Path
) -> providers.ProviderChoice:
    """ONNX Runtime's CUDA GroupQueryAttention takes fp16 and bf16 only. In an fp32 graph
    attention falls back to the CPU and the whole KV cache crosses PCIe twice a step:
    236 ms a step for the 0.6B shape on an H100 against 29 ms on 8 of its CPU cores
    (docs/BENCHMARKS.md). `auto` then drafts on the CPU; an explicit `cuda` is kept,
    with the reason and the fix in the log."""
    if choice.name != "cuda" or not fp32_cache:
        return choice
    why = (
        f"{folder} is an fp32 graph: on CUDA its attention runs on the CPU with the KV cache "
        f"copied both ways every step (ONNX Runtime's CUDA GroupQueryAttention takes fp16 "
        f"or bf16), about 8x slower than drafting on the CPU; export it with "
        f"`npu-spec export-drafter ... --precision fp16` for CUDA"
    )
    if requested.lower() == "auto":
        log.warning("%s. Drafting on the CPU.", why)
        return providers.CPU
    log.warning("%s.", why)
    return choice
