"""What one benchmark run is, and what it returns.

A run serves ``Job``s (tokenised ``workloads.Request``s: ``make_jobs``) with one decoding configuration
(``Spec``: the drafter, or none for plain decoding, with its K and options) under one offered load (``Load``:
a closed loop of c clients, or Poisson arrivals at a rate into c engine rows), every request sampled the same
way (``Sampling``). ``runner.run`` serves them and returns a ``RunResult``: the per-request records, the run's
summary, decode statistics, memory and engine details, to which the suite adds phases, quality and the
cost-model check; ``RunResult.to_json`` is what the result files hold of it. ``plain_spec``, ``ngram_spec`` and
``model_spec`` make the configurations the suites compare.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jspec.bench.metrics import RequestRecord
from jspec.validate import DEFAULT_GAMMA, adaptive_policy

if TYPE_CHECKING:
    from jspec.bench.targets import Target


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling of every request in a run (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class Spec:
    """One decoding configuration: the drafter (None = plain decoding) and its static options.

    ``drafter`` must be hashable (it is a static argument of the jitted loop); ``draft_params`` is its pytree
    (excluded from equality and hashing). ``kind`` is "plain", "chain" or "tree"; ``label`` names the row in
    tables ("ngram K=4"); ``peer`` maps to the peer technique measured against it ("plain", "prompt_lookup",
    "assisted"). ``goodput``: K chosen each round up to ``gamma`` from measured round costs (the engine's
    ``goodput=True``; ``gamma`` is then the largest K, not a fixed one)."""

    label: str
    drafter: Any = None
    gamma: int | None = None
    draft_params: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    adaptive: Any = None
    block_verify: bool = False
    peer: str | None = None
    goodput: bool = False

    def __post_init__(self):  # adaptive as decode and Engine take it: True = the default AdaptiveK, False = none
        object.__setattr__(self, "adaptive", adaptive_policy(self.adaptive))
        if not isinstance(self.goodput, bool):
            raise ValueError(f"{self.label}: goodput must be True or False, got {self.goodput!r}")
        if self.goodput and (self.drafter is None or self.adaptive is not None):
            what = "a drafter" if self.drafter is None else "no adaptive policy (it chooses K itself)"
            raise ValueError(f"{self.label}: goodput (K chosen each round from measured costs) needs {what}")
        if self.gamma is None:  # the K decode takes when none is given: 0 plain, a tree's depth, else 4
            d = self.drafter
            k = 0 if d is None else d.max_depth if d.is_tree else DEFAULT_GAMMA
            object.__setattr__(self, "gamma", k)

    @property
    def engine_gamma(self) -> int | None:
        """The ``gamma`` the engine takes: None with goodput (the policy's largest K is its default, 4)."""
        return None if self.goodput else self.gamma

    @property
    def kind(self) -> str:
        if self.drafter is None:
            return "plain"
        return "tree" if self.drafter.is_tree else "chain"

    def describe(self) -> dict[str, Any]:
        d = self.drafter
        return {
            "label": self.label,
            "kind": self.kind,
            "drafter": None if d is None else type(d).__name__,
            "drafter_repr": None if d is None else _short_repr(d),
            "gamma": self.gamma if d is not None else 0,
            "adaptive": None if self.adaptive is None else dataclasses.asdict(self.adaptive),
            "block_verify": self.block_verify,
            "peer": self.peer,
            "goodput": self.goodput,
        }


def _short_repr(obj) -> str:
    if dataclasses.is_dataclass(obj):
        parts = []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            parts.append(f"{f.name}={getattr(v, 'name', None) or v!r}" if f.name == "model" else f"{f.name}={v!r}")
        return f"{type(obj).__name__}({', '.join(parts)})"[:300]
    return repr(obj)[:300]


@dataclasses.dataclass(frozen=True)
class Load:
    """The offered load. mode "closed": ``concurrency`` clients; mode "open": Poisson arrivals at ``rate``
    requests/s served by ``concurrency`` engine rows. ``timeout_s``: per-request deadline from arrival."""

    mode: str
    concurrency: int
    rate: float | None = None
    seed: int = 0
    timeout_s: float | None = None

    @classmethod
    def closed(cls, concurrency: int, timeout_s: float | None = None) -> Load:
        return cls("closed", concurrency, None, 0, timeout_s)

    @classmethod
    def open(cls, rate: float, rows: int, seed: int = 0, timeout_s: float | None = None) -> Load:
        return cls("open", rows, rate, seed, timeout_s)

    def __post_init__(self):
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode must be 'closed' or 'open', got {self.mode!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency (engine rows) must be >= 1, got {self.concurrency}")
        if self.mode == "open" and not (self.rate and self.rate > 0):
            raise ValueError(f"an open loop needs a rate > 0 requests/s, got {self.rate}")
        if self.timeout_s is not None and not self.timeout_s >= 0:  # 0: every request times out (a test of that)
            raise ValueError(f"timeout_s (the per-request deadline) must be >= 0 seconds or None, got {self.timeout_s}")

    @property
    def name(self) -> str:
        if self.mode == "closed":
            return f"closed c={self.concurrency}"
        return f"open {self.rate:g}/s rows={self.concurrency}"


@dataclasses.dataclass(frozen=True)
class Job:
    """A tokenised request: ``prompt`` ids (None if building it failed, with ``error``)."""

    id: str
    workload: str
    prompt: tuple[int, ...] | None
    error: str | None = None
    request: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)


def make_jobs(requests: Sequence, tokenizer, chat_template: bool = True) -> list[Job]:
    """Tokenise ``workloads.Request`` objects with the target's chat template (or raw text). A request whose
    tokenisation raises becomes a job carrying that error, recorded as a failed request by the run."""
    jobs = []
    for r in requests:
        try:
            ids = tokenizer.encode_chat(list(r.messages)) if chat_template else tokenizer.encode(r.prompt_text())
            jobs.append(Job(r.id, r.workload, tuple(int(i) for i in ids), None, r))
        except Exception as e:
            jobs.append(Job(r.id, r.workload, None, f"{type(e).__name__}: {e}", r))
    return jobs


@dataclasses.dataclass
class RunResult:
    """One run: configuration, per-request records, run summary, decode statistics, memory."""

    spec: Spec
    load: Load
    sampling: Sampling
    max_new_tokens: int
    records: list[RequestRecord]
    summary: dict[str, Any]
    decode_stats: dict[str, Any]
    memory: dict[str, Any]
    engine: dict[str, Any]
    phases: dict[str, Any] | None = None
    cost_model: dict[str, Any] | None = None
    quality: dict[str, Any] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.spec.label

    def tokens_by_id(self) -> dict[str, list[int]]:
        return {r.id: r.tokens for r in self.records if r.ok}

    def itl_ms(self) -> list[float]:
        return [x * 1e3 for r in self.records if r.ok for x in r.itl()]

    def to_json(self, with_requests: bool = True) -> dict[str, Any]:
        out = {
            "spec": self.spec.describe(),
            "load": dataclasses.asdict(self.load),
            "load_name": self.load.name,
            "sampling": dataclasses.asdict(self.sampling),
            "max_new_tokens": self.max_new_tokens,
            "summary": self.summary,
            "decode_stats": self.decode_stats,
            "memory": self.memory,
            "engine": self.engine,
            "phases": self.phases,
            "cost_model": self.cost_model,
            "quality": self.quality,
            **self.extra,
        }
        if with_requests:
            out["requests"] = [r.to_json() for r in self.records]
            # Pooled inter-token intervals (ms) for the latency-distribution plots.
            out["itl_ms_all"] = [round(x, 3) for x in self.itl_ms()]
        return out


def plain_spec() -> Spec:
    return Spec("plain", peer="plain")


def ngram_spec(target: Target, gamma: int = 4, max_ngram: int = 3, min_ngram: int = 1, adaptive=None,
               goodput: bool = False) -> Spec:  # fmt: skip
    """The n-gram drafter at K = ``gamma``; with ``goodput`` K is chosen each round up to ``gamma`` (labelled as
    the grid labels it, "ngram goodput K<=4")."""
    from jspec.ngram import NgramDrafter

    if goodput and gamma != DEFAULT_GAMMA:  # the engine's goodput=True chooses among K up to its default K
        raise ValueError(f"goodput chooses K up to {DEFAULT_GAMMA} (the engine's default), not up to {gamma}")
    d = NgramDrafter(max_ngram, min_ngram, vocab_size=target.model.vocab_size)
    variant = (max_ngram, min_ngram) != (3, 1)
    label = (f"ngram goodput K<={gamma}" if goodput else f"ngram K={gamma}") + (
        f" n={max_ngram}..{min_ngram}" if variant else ""
    )
    if goodput:  # no peer runs a goodput-chosen K
        return Spec(label, d, gamma, None, adaptive=adaptive, goodput=True)
    # Compared with the peers' prompt lookup only when configured like it (n-grams 3..1); K is checked where the
    # peers' K is known: ``headline`` and ``tables.peers_table`` give no ratio against a peer that ran another K
    # (``ratios.ratio_blockers``).
    spec = Spec(label, d, gamma, None, adaptive=adaptive, peer=None if variant else "prompt_lookup")
    return dataclasses.replace(spec, label=label + " adaptive") if spec.adaptive is not None else spec


def model_spec(label: str, draft_model, draft_params, gamma: int = 4, peer: str | None = "assisted") -> Spec:
    from jspec.drafters import ModelDrafter

    return Spec(label, ModelDrafter(draft_model), gamma, draft_params, peer=peer)
