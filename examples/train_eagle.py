"""Train an EAGLE draft head for SmolLM2-135M on the target's own text and features, then measure acceptance.

1. On-policy data: the TARGET answers chat prompts (written below) and requests about Python standard-library
   docstrings (real text shipped with Python) through ``jspec.decode``, batched, alternating greedy and
   T = ``--temperature`` batches.
2. Features: one target pass over prompt + answer gives f_t (final normed hidden) at every position; stored
   as float16 next to the tokens (the target's next-token distribution is recomputed from f_t during training:
   the LM head is a fixed linear map, so nothing else needs storing).
3. Frequent-token map: the N (``--head-tokens``) most frequent tokens of the generated answers, EOS always in.
4. Training (optax AdamW, warm-up + cosine): on windows of ``--window`` tokens, the head runs ``--unroll``
   passes of training-time test (pass u feeds on pass u-1's predictions and attends as draft step u does,
   ``models.eagle.head_unrolled``); loss per pass = ``--reg-weight`` * smooth-L1(f^, f) + ``--ce-weight`` *
   KL(target restricted to the N tokens || head), pass u weighted ``--pass-decay``^u. tqdm bar; resumable
   ``ocp.CheckpointManager``.
5. Evaluation: acceptance per draft position with ``jspec.decode`` on held-out chat prompts, greedy and T = 1,
   and the training passes teacher-forced on the held-out greedy answers (what position-1 acceptance tracks;
   the rollout computes exactly what training computes, see tests/test_eagle.py). The agreement printed during
   training is in-sample: on the answers (``agree_answer``) it is ~0.5 where held-out text gets ~0.3.

Everything goes to ``${JSPEC_CACHE:-~/.cache/jspec}/eagle/<name>/`` (data, checkpoints, ``head/``,
``eval.json``), never into the repository; a rerun with a finished head only prints its evaluation unless
``--force`` (evaluating it first when it has none, or one made with other ``--gamma`` / ``--eval-max-new``).
Defaults: the first 448 training prompts answered once (14 batches of 32, ~56k generated tokens) plus ~40k
docstring tokens, 3 epochs (360 steps). ``--gen-batches 31`` answers 992 of the 1018 prompts
(EXTRA_TOPICS come last, so the first 14 batches are the same). The text and features come from the CPU
kernels' layout, ~18 s a batch on a 2-core CPU; training took 8 min for the defaults. The data is cached per
batch: a retrain with other head settings only pays for training, a larger budget only for the new batches.
``--gen-batches`` and ``--doc-tokens`` set the data budget, which limits a small one: with 3 batches (~12k
tokens, 2 epochs) its held-out first-position acceptance was 0.24-0.27, with the defaults 0.30 (greedy, K=4;
0.57 on its own training answers). ``--name smollm2-8k-xl --gen-batches 31`` (125k generated tokens, 663
steps; data 6 min, training 16 min): 0.35 greedy and 0.30 at T = 1 (the defaults: 0.30 and 0.25), teacher-
forced 0.42 (0.38); 0.60 on its own training answers. ``--name smollm2-8k-long --max-new 384 --gen-batches 24
--doc-tokens 200000 --epochs 3`` (262k generated tokens in answers of up to 384, ~180k of shipped text, 1407
steps; data 22 min, training ~40 min): 0.35 greedy and 0.36 at T = 1, teacher-forced 0.41. After its first
epoch alone (469 steps) it had 0.30 / 0.35: past ~100k tokens the head wants training steps more than text.

``--fuse 2,15`` trains an EAGLE-3-style fused head (the outputs of target layers 2 and 15 join f; their
features are computed once from the cached tokens and stored next to each data file). On the default data it
matched the unfused head (held out, 6 prompts x 192 tokens: first position 0.35 both, teacher-forced 0.38
against 0.39). ``--fuse`` with ``--init-from`` an unfused head grafts a fusion onto it that starts as the
identity on f (``models.eagle.graft_fusion``): on mp2 and its data, held out 1.92 tokens per round against 1.85
(docs/results.md, fifteenth session). ``--head-layers 2`` with ``--init-from`` grafts a second decoder layer on
top that starts as the identity (``models.eagle.graft_layers``): on mp5 and its data, one epoch of it matched one
more epoch of the one-layer head (held out 0.552 at the first position, both; twentieth session).
``--init-from NAME`` fine-tunes a trained head (same shape; its token map is kept), e.g. on a larger
``--gen-batches`` budget: past the first 1018 prompts come the STYLES requests (other kinds of request
over every topic). ``--name smollm2-8k-long2 --max-new 384 --gen-batches 42 --doc-tokens 200000 --epochs 1
--init-from smollm2-8k-long --lr 5e-4`` (18 more batches, 10 of them STYLES requests; 27 + 19 min): held out at
192 tokens, first position 0.46 and teacher-forced 0.48 against the long head's 0.41 / 0.44. Once more:
``--name smollm2-8k-long3 --gen-batches 66 --init-from smollm2-8k-long2`` (same other flags; 24 batches of
STYLES requests more, 669k generated tokens; ~22 + 26 min): 0.48 / 0.50. ``--gen-batches`` also takes ranges
(``0-11,32-51``: batch i answers training prompts [32 i, 32 i + 32), the STYLES requests start at batch 32), so a
budget can go to those requests directly while the batches already cached are reused.

``--self-batches N`` answers N batches of requests the target writes itself (Magpie, Xu et al. 2024: sampled at
T = 1 from the chat template cut where a user's message starts; kept when finished, four words or more, not a
repeat, and sharing under half their words with every held-out and benchmark prompt), so the data follows the
target's own idea of what users ask rather than our templates (~34 s a batch of 32 at ``--max-new 384`` on a
2-core Zen 5 EPYC). Teacher-forced on greedy answers, st3 (below) agreed 0.65 at the first position on prompts it
was trained on, 0.55 on unseen prompts of the same templates and 0.45-0.47 on open chat: the templates, not the
data size, were what held it back. ``--gen-batches none`` makes them the only data.

``--export DIR`` also writes the finished head with bf16 weights (``models.eagle.export_head``, ~6.6 MB), its
held-out evaluation in meta.json. ``models/heads/smollm2-8k-chat-mp5``, the head ``--drafter eagle`` takes by
default, is mp3 fine-tuned once more with a new token map: ``--name smollm2-8k-chat-mp5 --init-from MP3 --remap
--gen-batches none --self-batches 24 --max-new 384 --epochs 1 --lr 3e-4 --doc-tokens 0 --eval-max-new 192`` (MP3:
``models/heads/smollm2-8k-chat-mp3`` at commit 1258c00; 211k generated tokens, the first 24 of mp3's batches; 31 +
6 min on a 2-core Xeon). mp3's map, inherited from the first heads' templated data, covered 90.7% of those
answers and 89.6% of the held-out greedy answers; the new one covers 99.2% and 93.0%. Held out, teacher-forced on
12 prompts (``examples/eagle_agreement.py``): 0.544 0.489 0.465 against mp3's 0.523 0.472 0.447 (mp3 under the
new map alone, no training: 0.539); greedy K=4 1.91 tokens per round on the 6 evaluation prompts (mp3's 1.93
below was measured on another machine; a one-epoch fine-tune with mp3's own map, on the Xeon, 1.85); T=1 K=2 over
seeds 1-6 on the 12 prompts 1.595 against mp3's 1.587. mp3 is st3 fine-tuned three times on self-written
requests: ``--name smollm2-8k-chat-mp --init-from DIR
--gen-batches none --self-batches 48 --max-new 384 --epochs 1 --lr 3e-4 --doc-tokens 0 --eval-max-new 192`` (DIR:
st3's bf16 export, ``models/heads/smollm2-8k-chat-st3`` at commit 07c92a8; 414k generated tokens; 28 + 7 min), then
``--name smollm2-8k-chat-mp2 --init-from smollm2-8k-chat-mp --self-batches 96`` (the other flags the same; 816k
tokens, the first 48 batches reused; 27 + 14 min; bundled until commit a2beff3), then ``--name smollm2-8k-chat-mp3
--init-from smollm2-8k-chat-mp2 --self-batches 160 --export models/heads/smollm2-8k-chat-mp3`` (bundled until
commit 1258c00; 1.38M tokens, the
first 96 batches reused; 37 + 24 min). Held out at 192 tokens, greedy K=4: 1.93 tokens per round, per position
0.49 0.24 0.13 0.07, teacher-forced 0.51 0.46 0.44; T=1: 1.73 with seed 0, 1.73 over seeds 1-6 (mp2: 1.85, 0.46
0.22 0.11 0.06, 0.50 0.46 0.44, T=1 1.81 and 1.69; st3: 1.76, 0.47 0.43 0.40, T=1 1.69). st3 (in git history,
commit 07c92a8) took four runs (Zen 3 times): ``--name smollm2-8k-chat --eval-max-new 192`` (the default data
and steps; 29 + 17 min), then
``--name smollm2-8k-chat-st --init-from smollm2-8k-chat --max-new 384 --gen-batches 0-11,32-51 --epochs 1 --lr 5e-4
--eval-max-new 192`` (41 + 14 min; it started from the bf16 export of the first, bundled until then), then ``--name
smollm2-8k-chat-st2 --init-from smollm2-8k-chat-st --gen-batches 0-11,32-67 --lr 3e-4`` (other flags the same; 20 +
15 min), then ``--name smollm2-8k-chat-st3 --init-from smollm2-8k-chat-st2 --gen-batches 0-11,32-83 --export
models/heads/smollm2-8k-chat-st3`` (the same again; 20 + 19 min; 612k generated tokens in all). Held out at 192
tokens, greedy K=4: first position 0.45, teacher-forced 0.47, 1.76 tokens per round (the first run alone: 0.35 /
0.38 / 1.55).
``--init-from models/heads/NAME`` fine-tunes a bundled head on a machine without the cache.
``--ffn 4608`` (a head layer three times as wide, from scratch on all 84 cached batches, ``--epochs 2``, 88 min):
held out 1.90 tokens per round, per position 0.46 0.26 0.13 0.07 (st3: 1.76), T=1 the same as st3; it reads
14.2M parameters per draft step against 8.9M and was as fast as st3 within noise (docs/results.md).

The exported meta.json says what the held-out evaluation computed with next to the export's ``stored_dtype``:
``evaluated_dtype`` and ``evaluated_layout`` (the f32 head on the stacked, unpacked f32 target), not the bf16
export.

    python examples/train_eagle.py [--name smollm2-8k] [--head-tokens 8192] [--gen-batches 3] [--force]
        [--export models/heads/NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import inspect
import json
import os
import re
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _run_settings as RS  # noqa: E402

from jspec import decode as dec  # noqa: E402
from jspec.cost_model import conditional_rates_from_stats  # noqa: E402
from models import eagle as EG  # noqa: E402
from models import llama, registry  # noqa: E402

TOPICS = [
    "bread baking", "the solar system", "learning a new language", "saving money", "running a marathon",
    "growing tomatoes", "the French Revolution", "climate change", "writing a resume", "meditation",
    "electric cars", "the human heart", "chess openings", "photography", "volcanoes", "time management",
    "coffee", "the Roman Empire", "machine learning", "recycling", "dogs as pets", "public speaking",
    "the water cycle", "healthy sleep", "the internet", "friendship", "camping", "jazz music",
    "renewable energy", "the stock market", "ancient Egypt", "video games", "yoga", "bees", "the moon",
    "cooking pasta", "job interviews", "rainforests", "smartphones", "the immune system", "painting",
    "earthquakes", "kindness", "the Olympic Games", "budget travel", "vitamins", "cybersecurity",
]  # fmt: skip
# More topics for a larger data budget (``--gen-batches`` past the first 14): their prompts come after every
# prompt of TOPICS, so a larger budget keeps the batches a smaller one generated (the data cache is per batch).
EXTRA_TOPICS = [
    "origami", "the printing press", "sharks", "hiking safety", "first aid", "the history of tea", "knitting",
    "black holes", "composting", "the Great Wall of China", "solar panels", "birdwatching", "board games",
    "the Renaissance", "gardening in small spaces", "learning to swim", "volunteering", "the ocean tides",
    "baking cookies", "fossils", "the human brain", "cats as pets", "starting a small business", "podcasts",
    "the Industrial Revolution", "rain gardens", "healthy breakfasts", "mountain climbing", "the piano",
    "recycling electronics", "tornadoes", "honey", "the Silk Road", "minimalism", "public libraries",
    "electric bikes", "the Amazon river", "map reading", "cloud computing", "dinosaurs", "staying hydrated",
    "the Vikings", "home insulation", "penguins", "robots", "wildfires", "learning to draw",
    "the metric system", "friendly debate", "the history of money", "glaciers", "wind turbines", "coral reefs",
    "team sports", "cooking rice", "the Moon landing", "insomnia", "3D printing", "the Eiffel Tower",
    "calligraphy", "whales", "saving water at home", "the periodic table", "street food", "trains",
    "negotiation", "sundials", "the northern lights", "mushrooms", "typing faster",
]  # fmt: skip
TEMPLATES = [
    "Can you explain {t} to a beginner?",
    "What are the most important things to know about {t}?",
    "Give me some practical tips about {t}.",
    "Write a short story that involves {t}.",
    "What are common misconceptions about {t}?",
    "Write a short blog post about {t}.",
    "What are the pros and cons of {t}?",
    "How would you teach a child about {t}?",
]
# Other kinds of request over every topic, after all of the above (so the batches that a smaller budget
# generated stay the same): the held-out and benchmark prompts are open chat in many forms, and a head trained
# on eight request templates learns their answers' shapes more than the target's.
STYLES = [
    "What are some fun facts about {t}?",
    "Write a friendly email to a friend about {t}.",
    "Summarize what everyone should know about {t} in five bullet points.",
    "Why do people care about {t}?",
    "Write a short poem about {t}.",
    "Explain {t} using a simple analogy.",
    "What questions should I ask an expert on {t}?",
    "Give me a step-by-step plan to get started with {t}.",
    "Describe a typical day for someone who works with {t}.",
    "What is the history of {t} in a few sentences?",
    "Write a dialogue between two friends discussing {t}.",
    "What mistakes do beginners make with {t}, and how can they avoid them?",
    "Compare {t} today with how it was fifty years ago.",
    "Write a short speech to encourage students to learn about {t}.",
    "I am bored. Suggest three activities related to {t}.",
    "What would the world be like without {t}?",
    "Write a product description for a book about {t}.",
    "Explain {t} to a ten-year-old.",
    "What are five interesting questions about {t}, with short answers?",
    "Tell me a funny story about {t}.",
]
DOC_MODULES = (
    "json os collections itertools functools textwrap string random math statistics datetime pathlib re".split()
)
# Held out: never used for training data (open chat prompts, like the benchmark's).
EVAL_PROMPTS = [
    "What should I pack for a weekend trip to the mountains?",
    "How can I become a better listener?",
    "Explain the difference between weather and climate.",
    "Write a friendly email inviting my neighbours to a picnic.",
    "Give me ideas for a vegetarian dinner.",
    "Why do leaves change colour in autumn?",
]


def docstring_prompts(max_chars: int = 600) -> list[str]:
    """Requests about stdlib docstrings: real English text shipped with Python, no download."""
    out = []
    for mod_name in DOC_MODULES:
        mod = importlib.import_module(mod_name)
        for name, obj in inspect.getmembers(mod):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and 150 <= len(doc) <= max_chars:
                out.append(f"Explain in simple words what the Python function {mod_name}.{name} does:\n\n{doc}")
    return out


def training_prompts(seed: int, doc_every: int = 4) -> list[str]:
    """Chat prompts with a docstring request every ``doc_every``-th entry, shuffled deterministically."""
    rng = np.random.default_rng(seed)
    chat = [tpl.format(t=t) for t in TOPICS for tpl in TEMPLATES]
    docs = docstring_prompts()
    rng.shuffle(chat)
    rng.shuffle(docs)
    out, d = [], 0
    for i, c in enumerate(chat):
        if i % doc_every == doc_every - 1 and d < len(docs):
            out.append(docs[d])
            d += 1
        out.append(c)
    extra = [tpl.format(t=t) for t in EXTRA_TOPICS for tpl in TEMPLATES]
    rng.shuffle(extra)
    styled = [tpl.format(t=t) for t in TOPICS + EXTRA_TOPICS for tpl in STYLES]
    rng.shuffle(styled)
    return out + extra + styled


def encode(tok, text: str, max_prompt: int, quiet: bool = False) -> list[int]:
    """The chat-formatted request, cut to its last ``max_prompt`` tokens (``--max-prompt``; said when it
    happens, unless ``quiet``: 5 of the 3358 templated requests are longer than the default 192 and lose their
    system turn)."""
    ids = tok.encode_chat([{"role": "user", "content": text}])
    if len(ids) > max_prompt and not quiet:
        print(f"request of {len(ids)} tokens cut to its last {max_prompt} (--max-prompt): {text[:60]!r}...")
    return ids[-max_prompt:]


# ---- stages 1-2: target text and features ---------------------------------------------------------------


def feature_fn(cfg, layers: tuple[int, ...] = ()):
    """jit: (params, tokens [B, W]) -> f [B, W, E], the target's final normed hidden at every position, or with
    ``layers`` the outputs of those layers only [B, W, len(layers) E] (the fused head's extra features). The
    LM head runs on one token per row only (``logits_at``): its [B, W, V] logits would be ~20% of the work
    and, at W = 576, ~0.9 GB for 8 rows. params are an argument, never a baked-in constant."""

    @jax.jit
    def features(params, tokens):
        b, w = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
        cache = llama.init_cache(cfg, b, w)
        at = jnp.zeros((b,), jnp.int32)
        _, f, _ = llama.forward(cfg, params, tokens, pos, cache, return_hidden=True, logits_at=at, hidden_layers=layers)
        return f[..., : len(layers) * cfg.hidden] if layers else f

    return features


def tokens_digest(tokens: np.ndarray, lengths: np.ndarray) -> str:
    """sha256 of a data file's tokens and lengths (their dtypes and shapes included): what its layer file was
    computed from."""
    h = hashlib.sha256()
    for a in (np.ascontiguousarray(tokens), np.ascontiguousarray(lengths)):
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def layer_files(args, target, files: list[str]) -> list[str]:
    """Next to each data file, the outputs of the ``--fuse`` layers [B, W, len(fuse) E] float16, computed from
    its tokens (one target pass; the generated text is not regenerated), cached per layer set. A layer file
    records the ``tokens_digest`` of the tokens it was computed from; one whose data file was written again since
    (a deleted batch regenerated), or made before the digest was recorded, is computed again."""
    if not args.fuse:
        return []
    features = feature_fn(target.config, args.fuse)
    tag = "-".join(str(i) for i in args.fuse)
    out = []
    for f in tqdm(files, desc=f"layer {tag} features", unit="file"):
        path = f"{f[:-4]}.layers{tag}.npz"
        out.append(path)
        with np.load(f) as d:
            tokens, lengths = d["tokens"], d["lengths"]
        digest = tokens_digest(tokens, lengths)
        if os.path.exists(path):
            with np.load(path) as d:
                stored = str(d["digest"]) if "digest" in d else None
            if stored == digest:
                continue
            if stored:
                tqdm.write(f"{path}: computed from other tokens than {f} holds now (written again): computing it again")
            else:
                tqdm.write(f"{path}: made before layer files recorded their data file's tokens: computing it again")
        w = min(-(-int(lengths.max()) // 32) * 32, tokens.shape[1])
        lf = np.zeros(tokens.shape + (len(args.fuse) * target.config.hidden,), np.float16)
        for r in range(0, tokens.shape[0], args.feature_batch):
            out_r = features(target.params, jnp.asarray(tokens[r : r + args.feature_batch, :w]))
            lf[r : r + args.feature_batch, :w] = as_float16(out_r, f"the outputs of layers {tag}")
        np.savez(path + ".tmp.npz", layer_feats=lf, digest=np.asarray(digest))
        os.replace(path + ".tmp.npz", path)
    return out


def as_float16(x, what: str) -> np.ndarray:
    """``x`` as the float16 the data files store, refusing values past its range (65504): a target whose
    residual stream runs that large would store inf and train the head on NaN losses with no other sign."""
    x = np.asarray(x)
    big = float(np.max(np.abs(x))) if x.size else 0.0
    if not np.isfinite(big) or big > float(np.finfo(np.float16).max):
        raise SystemExit(f"{what} reach {big:.4g}, past float16's range ({np.finfo(np.float16).max:g}): the data files "
                         "store features in float16, which would hold inf there")  # fmt: skip
    return x.astype(np.float16)


def batch_ids(spec) -> list[int]:
    """``--gen-batches``: N (batches 0 .. N-1) or ranges and indices, e.g. '0-11,32-51'. Batch i answers
    training prompts [i * gen_batch, (i + 1) * gen_batch), so ranges pick which requests to spend the budget on
    (the STYLES requests start at batch 32) while the batches already cached stay usable."""
    if str(spec).strip().lower() == "none":  # only --self-batches (or the docstrings) as data
        return []
    if isinstance(spec, int) or str(spec).isdigit():
        n = int(spec)
        if n < 1:
            raise SystemExit(f"--gen-batches {spec}: at least one batch")
        return list(range(n))
    ids = set()
    for part in str(spec).split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise SystemExit(f"--gen-batches {spec!r}: expected N or ranges like '0-11,32-51' (got {part!r})")
        ids.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    return sorted(ids)


def generate_data(args, target, data_dir: str) -> list[str]:
    """One npz per batch: tokens [B, W] (prompt + answer, right-padded), lengths, prompt lengths, features
    [B, W, E] float16. Existing batches are kept (a rerun resumes)."""
    prompts = training_prompts(args.seed)
    ids = batch_ids(args.gen_batches)
    if ids and (ids[-1] + 1) * args.gen_batch > len(prompts):
        raise SystemExit(
            f"--gen-batches {args.gen_batches} x --gen-batch {args.gen_batch} asks for more than the "
            f"{len(prompts)} training prompts: lower one of them"
        )
    if not ids:
        return []
    features = feature_fn(target.config)

    def chunk(i):
        return prompts[i * args.gen_batch : (i + 1) * args.gen_batch]

    def make(i, path):
        prompt_ids = [encode(target.tokenizer, p, args.max_prompt) for p in chunk(i)]
        temp = 0.0 if i % 2 == 0 else args.temperature  # greedy and sampled text: both decoding modes
        return answer_batch(args, target, features, prompt_ids, temp, args.seed * 1000 + i, path, prompts=chunk(i))

    def check(i, path):
        check_batch_prompts(path, chunk(i), target.tokenizer, args.max_prompt)

    return cached_batches(data_dir, "batch", ids, "target text + features", make, check)


def check_batch_prompts(path: str, prompts: list[str], tok, max_prompt: int) -> None:
    """A cached ``batch_*`` file must answer the prompts this run puts in that batch, which depend on the Python
    version (``training_prompts`` shuffles the stdlib's docstring requests, whose number differs between versions,
    with the generator that then shuffles the rest). Compared on the requests the file stores (``prompts``), or,
    in a file written before they were stored, on its prompt tokens (``encode`` of this run's requests): a
    mismatch is refused naming the file, rather than training on a mix of two orders (some requests twice,
    others never)."""
    with np.load(path) as d:
        if "prompts" in d:
            theirs, mine = [str(t) for t in d["prompts"]], list(prompts)
        else:
            theirs = [d["tokens"][r, :n].tolist() for r, n in enumerate(d["prompt_lengths"])]
            mine = [encode(tok, p, max_prompt, quiet=True) for p in prompts]
    if theirs != mine:
        r = next((r for r, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(theirs), len(mine)))
        here = repr(prompts[r][:60]) if r < len(prompts) else "none"
        raise SystemExit(
            f"{path} answers other requests than this run puts in that batch (row {r}: this run's is {here}; "
            f"{len(theirs)} rows there, {len(mine)} here). Which requests land in a batch depends on the Python "
            "version (its docstrings are among them) and this script's prompt lists: run the Python version that "
            f"wrote the folder's batches, or delete its batch_*.npz files to write them again ({os.path.dirname(path)})"
        )


def cached_batches(data_dir: str, name: str, ids: list[int], desc: str, make, check=None) -> list[str]:
    """One npz per batch i, ``data_dir/<name>_<i:04d>.npz``; ``make(i, path)`` writes a missing one and returns
    its generated-token count (the progress bar's). Existing batches are kept, so a rerun resumes; ``check(i,
    path)``, if given, vets each one (raising SystemExit to refuse it)."""
    os.makedirs(data_dir, exist_ok=True)
    files = []
    bar = tqdm(ids, desc=desc, unit="batch")
    for i in bar:
        files.append(os.path.join(data_dir, f"{name}_{i:04d}.npz"))
        if not os.path.exists(files[-1]):
            bar.set_postfix(new_tokens=make(i, files[-1]))
        elif check is not None:
            check(i, files[-1])
    return files


def answer_batch(args, target, features, prompt_ids: list[list[int]], temp: float, seed: int, path: str, **extra):
    """The target answers ``prompt_ids`` (``--max-new`` tokens at ``temp``); tokens, lengths and its features
    go to ``path`` (written atomically, with ``extra`` arrays). Returns the number of generated tokens."""
    tok, cfg = target.tokenizer, target.config
    width = args.max_prompt + args.max_new
    out = dec.decode(
        target.model,
        target.params,
        prompt_ids,
        max_new_tokens=args.max_new,
        temperature=temp,
        eos_ids=tok.eos_ids,
        seed=seed,
    )
    seqs = [p + t for p, t in zip(prompt_ids, out.tokens)]
    tokens = np.zeros((len(seqs), width), np.int32)
    for r, s in enumerate(seqs):
        tokens[r, : len(s)] = s
    w = min(-(-max(len(s) for s in seqs) // 32) * 32, width)
    feats = np.zeros((len(seqs), width, cfg.hidden), np.float16)
    for r in range(0, len(seqs), args.feature_batch):  # [B, W, V] logits at once would take ~1 GB
        feats[r : r + args.feature_batch, :w] = as_float16(
            features(target.params, jnp.asarray(tokens[r : r + args.feature_batch, :w])), "target features"
        )
    np.savez(
        path + ".tmp.npz",
        tokens=tokens,
        lengths=np.array([len(s) for s in seqs], np.int32),
        prompt_lengths=np.array([len(p) for p in prompt_ids], np.int32),
        feats=feats,
        temperature=np.float32(temp),
        **extra,
    )
    os.replace(path + ".tmp.npz", path)
    return sum(out.stats["new_tokens"])


def user_turn_prefix(tok) -> list[int]:
    """The chat template up to where a user's message starts (system turn + ``<|im_start|>user\\n``)."""
    mark = "\x00USER\x00"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], False)
    return tok.encode(text[: text.index(mark)], add_bos=False, add_eos=False)  # a prefix: nothing appended


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9']+", text.lower()))


def too_close(text: str, held_out: list[str], threshold: float = 0.5) -> bool:
    """Word-set Jaccard similarity >= ``threshold`` with any held-out prompt: such a request is dropped, so
    self-written training prompts cannot restate an evaluation or benchmark prompt."""
    w = _words(text)
    return any(len(w & h) / max(len(w | h), 1) >= threshold for h in map(_words, held_out))


def self_prompts(target, batch: int, seed: int, held_out: list[str], max_len: int = 96) -> list[str]:
    """``batch`` user requests written by the target itself (Magpie, Xu et al. 2024): sampled at T = 1 from the
    chat template cut where a user message starts, so the requests follow the target's own idea of what users
    ask (far more kinds than our templates). Kept: finished within ``max_len`` tokens, at least four words,
    not a repeat, not ``too_close`` to a held-out prompt. Deterministic in ``seed``."""
    tok = target.tokenizer
    prefix = user_turn_prefix(tok)
    kept, seen = [], set()
    for attempt in range(8):
        out = dec.decode(
            target.model,
            target.params,
            [prefix] * (2 * batch),
            max_new_tokens=max_len,
            temperature=1.0,
            eos_ids=tok.eos_ids,
            seed=seed * 100 + attempt,
        )
        for t in out.tokens:
            if not t or t[-1] not in tok.eos_ids:
                continue  # ran past max_len: not a finished request
            text = tok.decode(t[:-1]).strip()
            key = " ".join(sorted(_words(text)))
            if len(text.split()) < 4 or key in seen or too_close(text, held_out):
                continue
            seen.add(key)
            kept.append(text)
            if len(kept) == batch:
                return kept
    raise SystemExit(f"self-written prompts: only {len(kept)} of {batch} usable after 8 tries (seed {seed})")


def held_out_prompts() -> list[str]:
    """Every prompt an evaluation reads: EVAL_PROMPTS and the benchmark's (examples/bench_eagle.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_eagle import PROMPTS

    return list(EVAL_PROMPTS) + list(PROMPTS)


def generate_self_data(args, target, data_dir: str) -> list[str]:
    """``--self-batches``: batch i answers ``--gen-batch`` requests the target wrote itself (``self_prompts``,
    seed i), greedy for even i and ``--temperature`` for odd; the requests are stored in the npz (``prompts``)."""
    if not args.self_batches:
        return []
    features = feature_fn(target.config)
    held_out = held_out_prompts()

    def make(i, path):
        texts = self_prompts(target, args.gen_batch, args.seed * 1000 + i, held_out)
        prompt_ids = [encode(target.tokenizer, p, args.max_prompt) for p in texts]
        temp = 0.0 if i % 2 == 0 else args.temperature
        seed = args.seed * 1000 + 500 + i
        return answer_batch(args, target, features, prompt_ids, temp, seed, path, prompts=texts)

    files = cached_batches(data_dir, "self", list(range(args.self_batches)), "self-written prompts", make)
    check_cached_prompts(files, held_out)
    return files


def check_cached_prompts(files: list[str], held_out: list[str]) -> None:
    """Batches written before a held-out prompt was added may restate it: the check made when a batch is
    written runs again on every cached one, and a hit is refused naming the file."""
    for path in files:
        with np.load(path) as d:
            texts = [str(t) for t in d["prompts"]] if "prompts" in d else []
        close = [t for t in texts if too_close(t, held_out)]
        if close:
            raise SystemExit(
                f"{path}: its request {close[0]!r} is too close to a held-out prompt (added after the batch was "
                "written): delete the file to write it again"
            )


def doc_answers(max_chars: int = 3000) -> list[tuple[str, str]]:
    """(request, docstring) pairs from the standard library: real English prose, shipped with Python."""
    out, seen = [], set()
    for mod_name in sorted(sys.stdlib_module_names):
        if mod_name.startswith("_") or mod_name in ("antigravity", "this", "idlelib", "tkinter", "turtle"):
            continue
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # a stdlib module this build lacks or cannot import here
            continue
        for name, obj in [(mod_name, mod)] + inspect.getmembers(mod):
            if name.startswith("_") or not (inspect.ismodule(obj) or inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and 200 <= len(doc) <= max_chars and doc not in seen:
                seen.add(doc)
                full = name if inspect.ismodule(obj) else f"{mod_name}.{name}"
                out.append((f"What does the Python {full} do?", doc))
    return out


def topic_answers(max_chars: int = 1200) -> list[tuple[str, str]]:
    """(request, passage) pairs from the Python reference manual's topics that ship with Python
    (``pydoc_data.topics``, what ``help('assert')`` prints), split at blank lines into passages of at most
    ``max_chars`` (a longer paragraph is a passage of its own)."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        passage = ""
        for para in topics[name].split("\n\n"):
            if passage and len(passage) + len(para) > max_chars:
                out.append((f"Explain this part of the Python reference manual on '{name}'.", passage.strip()))
                passage = ""
            passage += para + "\n\n"
        if len(passage.strip()) >= 200:
            out.append((f"Explain this part of the Python reference manual on '{name}'.", passage.strip()))
    return out


def generate_doc_data(args, target, data_dir: str) -> list[str]:
    """Off-policy real text, cheap: stdlib docstrings, then the reference manual's topics, laid out as
    assistant answers of a chat, ~``--doc-tokens`` tokens; only a target forward per token (no generation),
    features stored like ``generate_data``. The loss is distillation (the target's own distribution at every
    position), so the head learns the target's feature dynamics on this text, not the text. The docstrings come
    first in the same order as before the topics were added, so cached files stay valid."""
    if args.doc_tokens <= 0:
        return []
    os.makedirs(data_dir, exist_ok=True)
    tok, cfg = target.tokenizer, target.config
    width = args.doc_width
    rng = np.random.default_rng(args.seed)
    pairs = doc_answers()
    rng.shuffle(pairs)
    extra = topic_answers()
    rng.shuffle(extra)
    pairs += extra

    features = feature_fn(cfg)

    rows_per_file = args.feature_batch * 4
    n_files = -(-args.doc_tokens // (rows_per_file * width))
    if n_files * rows_per_file > len(pairs):
        raise SystemExit(
            f"--doc-tokens {args.doc_tokens} needs {n_files} files of {rows_per_file} passages ({width} tokens "
            f"each at most), more than the {len(pairs)} passages of text shipped with Python: lower it"
        )
    files, it, full_lengths = [], iter(pairs), []
    bar = tqdm(range(n_files), desc="docstring features", unit="file")
    for i in bar:
        path = os.path.join(data_dir, f"docs_{i:04d}.npz")
        files.append(path)
        seqs, plens = [], []
        while len(seqs) < rows_per_file:
            q, doc = next(it)
            user = [{"role": "user", "content": q}]
            prompt = tok.encode_chat(user)
            full = tok.encode_chat(user + [{"role": "assistant", "content": doc}], add_generation_prompt=False)
            seqs.append(full[:width])
            plens.append(len(prompt))
            full_lengths.append(len(full))
        if os.path.exists(path):  # the prompts above were still consumed: later files stay the same
            with np.load(path) as d:  # ... if the cached file holds as many passages as this run puts in one
                cached = [np.asarray(t[:n]).tolist() for t, n in zip(d["tokens"], d["lengths"])]
            if cached != seqs:
                raise SystemExit(
                    f"{path} holds other passages than this run would put there ({len(cached)} rows; this run "
                    f"writes {rows_per_file} per file, from --feature-batch {args.feature_batch}): use the "
                    "--feature-batch that wrote it, or delete the folder"
                )
            continue
        tokens = np.zeros((len(seqs), width), np.int32)
        for r, sq in enumerate(seqs):
            tokens[r, : len(sq)] = sq
        feats = np.zeros((len(seqs), width, cfg.hidden), np.float16)
        for r in range(0, len(seqs), args.feature_batch):
            feats[r : r + args.feature_batch] = as_float16(
                features(target.params, jnp.asarray(tokens[r : r + args.feature_batch])), "target features"
            )
        np.savez(
            path + ".tmp.npz",
            tokens=tokens,
            lengths=np.array([len(sq) for sq in seqs], np.int32),
            prompt_lengths=np.array(plens, np.int32),
            feats=feats,
            temperature=np.float32(-1),
        )
        os.replace(path + ".tmp.npz", path)
    note = cut_note(full_lengths, width)
    if note:
        print(note)
    return files


def cut_note(lengths: list[int], width: int) -> str | None:
    """What ``generate_doc_data`` cut: a passage (request + text, chat-formatted) longer than ``--doc-width``
    tokens keeps its first ``width`` (its end is never trained on). None when nothing was cut."""
    cut = [n for n in lengths if n > width]
    if not cut:
        return None
    return (
        f"docstring data: {len(cut)} of {len(lengths)} passages are longer than --doc-width {width} tokens (up to "
        f"{max(cut)}) and were cut to it: {sum(n - width for n in cut)} of the passages' {sum(lengths)} tokens are "
        "not trained on"
    )


def data_dir(args) -> str:
    key = f"{args.model}-T{args.temperature:g}-p{args.max_prompt}-n{args.max_new}-b{args.gen_batch}-s{args.seed}"
    return os.path.join(EG.cache_root(), "_data", key)


def load_windows(files: list[str], window: int, prompt_loss: bool, layers: list[str] | None = None):
    """Cut every sequence into windows of ``window`` pairs. Pair i of a window is (f_i, x_{i+1}) and its
    targets f_{i+1}, x_{i+2}: a window holds window + 1 tokens/features. Returns dict of arrays
    feats [M, w+1, R] float16 (R = E, or with ``layers``, the ``layer_files`` of ``files``, the fused layers'
    outputs then f: the head's raw features), tokens [M, w+1], mask [M, w] (pair i is trained), answer [M, w]
    (pair i is one the drafter meets when decoding: i >= P - 1, its x_{i+2} a token of the answer after the
    first, which the target samples at prefill) plus the answers."""
    feats, tokens, masks, in_answer, answers = [], [], [], [], []
    for fi, f in enumerate(files):
        d = dict(np.load(f))
        if layers:
            d["feats"] = np.concatenate([np.load(layers[fi])["layer_feats"], d["feats"]], axis=-1)
        for r in range(d["tokens"].shape[0]):
            n, p = int(d["lengths"][r]), int(d["prompt_lengths"][r])
            answers.append(d["tokens"][r, p:n])
            # Windows start at pair p-2, which predicts f_{p-1}: the prompt's last feature, from which the prefill
            # samples the answer's first token (never drafted, so that pair is left out of the loss: ``answer``).
            first = 0 if prompt_loss else max(p - 2, 0)
            for s in range(first, n - 1, window):
                e = min(s + window + 1, n)
                if e - s < 3:
                    continue
                tk = np.zeros(window + 1, np.int32)
                ft = np.zeros((window + 1, d["feats"].shape[2]), np.float16)
                tk[: e - s], ft[: e - s] = d["tokens"][r, s:e], d["feats"][r, s:e]
                m = np.zeros(window, bool)
                m[: e - s - 1] = True  # pair i needs x_{i+1} and f_{i+1} (whose LM head gives the CE target)
                tokens.append(tk)
                feats.append(ft)
                masks.append(m)
                in_answer.append(m & (s + np.arange(window) >= p - 1))
    data = {"feats": np.stack(feats), "tokens": np.stack(tokens), "mask": np.stack(masks)}
    return {**data, "answer": np.stack(in_answer)}, answers


# ---- stages 3-4: map, head, training --------------------------------------------------------------------


def make_loss(ecfg: EG.EagleConfig, args):
    decay = jnp.asarray([args.pass_decay**u for u in range(args.unroll)], jnp.float32)

    def loss_fn(trainable, token_ids, target_params, rows, feats, tokens, mask, answer, noise_key):
        """feats [B, w+1, R] (raw: fused layers then f), tokens [B, w+1], mask [B, w], answer [B, w] (metric
        only); rows [N, E] the subset's LM-head rows."""
        hp = {**trainable, "token_ids": token_ids}
        f_in = EG.fuse_features(ecfg, hp, feats[:, :-1].astype(jnp.float32))  # g_i (f_i without fusion)
        if args.noise:  # EAGLE's feature noise: the rollout reads imperfect features
            f_in = f_in + args.noise * jax.random.uniform(noise_key, f_in.shape, minval=-1.0, maxval=1.0)
        f_hat = EG.head_unrolled(ecfg, hp, target_params, f_in, tokens[:, 1:], args.unroll)  # [U, B, w, E]
        target = feats[:, 1:, -f_hat.shape[-1] :].astype(jnp.float32)  # f_{i+1}
        reg = jnp.mean(optax.huber_loss(f_hat, target[None], delta=1.0), axis=-1)  # [U, B, w]
        t_logp = jax.nn.log_softmax(EG.subset_logits(target, rows), axis=-1)  # [B, w, N] target on the subset
        logq = jax.nn.log_softmax(EG.subset_logits(f_hat.reshape((-1,) + f_hat.shape[2:]), rows), axis=-1)
        logq = logq.reshape(f_hat.shape[:3] + (-1,))
        p = jnp.exp(t_logp)
        kl = jnp.sum(p[None] * (t_logp[None] - logq), axis=-1)  # [U, B, w]
        agree = (jnp.argmax(logq, -1) == jnp.argmax(t_logp, -1)[None]).astype(jnp.float32)
        m = mask.astype(jnp.float32)[None]
        denom = jnp.maximum(jnp.sum(m), 1.0)
        per_pass = lambda x: jnp.sum(x * m, axis=(1, 2)) / denom  # noqa: E731
        loss = jnp.sum(decay * (args.reg_weight * per_pass(reg) + args.ce_weight * per_pass(kl))) / jnp.sum(decay)
        # In-sample agreement on the answers alone: the prompt's pairs include the chat template's fixed
        # system prompt, which the head memorises (~0.8 agreement) and the drafter never drafts.
        a = answer.astype(jnp.float32)[None]
        agree_answer = jnp.sum(agree * a, axis=(1, 2)) / jnp.maximum(jnp.sum(a), 1.0)
        metrics = {"loss": loss, "reg": per_pass(reg), "kl": per_pass(kl), "agree": per_pass(agree)}
        return loss, {**metrics, "agree_answer": agree_answer}

    return loss_fn


def draft_vocabulary(args, answers: list, vocab_size: int, eos_ids) -> np.ndarray | None:
    """The ``--head-tokens`` most frequent tokens of the generated answers (every end token in), or None: the full
    vocabulary, or a fine-tuned head's own map. ``--remap`` rebuilds a fine-tuned head's map from this run's
    data: its LM head is the target's tied rows, so a new map needs no new weights."""
    if (args.init_from and not args.remap) or not args.head_tokens or args.head_tokens >= vocab_size:
        return None
    counts = EG.token_counts(answers, vocab_size)
    token_ids = EG.frequent_tokens(counts, args.head_tokens, always=list(eos_ids))
    cover = counts[token_ids].sum() / max(counts.sum(), 1)
    print(f"draft vocabulary: {args.head_tokens} most frequent tokens cover {cover:.4f} of the generated text")
    return token_ids


def init_source(args, target_cfg):
    """The head ``--init-from`` names, checked against this run's head settings (a head of another shape
    cannot be fine-tuned into this one)."""
    src, hp = EG.restore_head(EG.resolve_head(args.init_from), target_cfg)
    mine = (args.head_tokens or target_cfg.vocab_size, args.ffn or target_cfg.ffn, tuple(args.fuse))
    theirs = (src.n, src.ffn or target_cfg.ffn, src.fuse)
    graft = not src.fuse and bool(args.fuse)  # an unfused head learns to fuse: it starts as itself
    if mine != theirs and not (graft and mine[:2] == theirs[:2]):
        raise SystemExit(
            f"--init-from {args.init_from}: that head has (head tokens, ffn, fuse) = {theirs}, this run asks "
            f"for {mine}: pass the same --head-tokens / --ffn, and the same --fuse or none on an unfused head"
        )
    layers = getattr(args, "head_layers", 0) or src.layers
    if layers < src.layers:
        raise SystemExit(
            f"--head-layers {layers}: --init-from {args.init_from} has {src.layers} layers (a head can gain "
            "layers, not lose them)"
        )
    if graft:
        src = dataclasses.replace(src, fuse=tuple(args.fuse))
        hp = EG.graft_fusion(src, hp)
    if layers > src.layers:  # the new layers start as the identity: the head drafts as before
        src = dataclasses.replace(src, layers=layers)
        hp = EG.graft_layers(src, hp, jax.random.key(getattr(args, "seed", 0)))
    return src, hp


def check_token_map(out_dir: str, token_ids, resuming: bool) -> None:
    """The frequent-token map a checkpoint was trained under, kept beside it (``token_ids.npy``): a resumed run
    that builds another one (the data, or the --init-from head it takes its map from, changed in between) is
    refused, since its weights would then draft other tokens than they learnt. A fresh run records its map."""
    path = os.path.join(out_dir, "token_ids.npy")
    here = np.asarray(token_ids, np.int32)
    if not resuming:
        os.makedirs(out_dir, exist_ok=True)
        np.save(path, here)
    elif os.path.isfile(path) and not np.array_equal(np.load(path), here):
        raise SystemExit(
            f"{out_dir}: its checkpoint was trained under another frequent-token map than this run builds (the data "
            "or the --init-from head changed since it was saved); resuming would pair its weights with other "
            "tokens: train under a new --name, or delete that directory to start over"
        )


def train(args, target, data, token_ids, out_dir: str):
    """(config, head params, per-step metrics, the step they start at, training seconds): the metrics and
    seconds of the steps before a resume come from ``save_history``'s file (``resumed_history``)."""
    t0 = time.perf_counter()
    layers = args.head_layers or 1
    ecfg = EG.EagleConfig(target.config, args.head_tokens, args.ffn, name=args.name, fuse=args.fuse, layers=layers)
    if args.init_from:  # fine-tuning: the trained head's weights and its own frequent-token map (or --remap's)
        src, hp = init_source(args, target.config)
        ecfg = dataclasses.replace(ecfg, layers=src.layers)
        if token_ids is not None:
            hp = {**hp, "token_ids": jnp.asarray(token_ids, jnp.int32)}
    else:
        hp = EG.init_head(ecfg, target.params, jax.random.key(args.seed), token_ids)
    trainable, ids = EG.split_trainable(hp)
    rows = EG.EagleDrafter(ecfg).draft_params(target.params, hp)[1]["rows"]
    m = data["tokens"].shape[0]
    steps_per_epoch = max(m // args.batch, 1)
    total = args.steps or args.epochs * steps_per_epoch
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, total // 4), total, args.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.98, weight_decay=args.weight_decay))
    opt_state = opt.init(trainable)
    loss_fn = make_loss(ecfg, args)
    tparams = {"embed": target.params["embed"]}  # all the head reads of the target

    @jax.jit
    def step(trainable, opt_state, tparams, rows, feats, tokens, mask, answer, key):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(trainable, ids, tparams, rows, feats, tokens, mask, answer, key)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, metrics

    mgr = ocp.CheckpointManager(
        os.path.abspath(os.path.join(out_dir, "ckpt")),
        options=ocp.CheckpointManagerOptions(max_to_keep=1, save_interval_steps=1),
    )
    hist_path = os.path.join(out_dir, "ckpt_history.json")
    check_token_map(out_dir, ids, resuming=mgr.latest_step() is not None)
    start = 0
    if mgr.latest_step() is not None:
        start = mgr.latest_step()
        state = mgr.restore(start, args=ocp.args.StandardRestore({"trainable": trainable, "opt": opt_state}))
        trainable, opt_state = state["trainable"], state["opt"]
        print(f"resumed from step {start}/{total}")
    history, from_step, seconds_before = RS.resumed_history(hist_path, start)
    bar = tqdm(range(start, total), desc="train head", unit="step", initial=start, total=total)
    for s in bar:
        # Deterministic in (seed, step): a resumed run sees the batches it would have seen.
        rng = np.random.default_rng((args.seed, s // steps_per_epoch))
        perm = rng.permutation(m)
        sel = np.sort(perm[(s % steps_per_epoch) * args.batch : (s % steps_per_epoch + 1) * args.batch])
        trainable, opt_state, met = step(
            trainable,
            opt_state,
            tparams,
            rows,
            jnp.asarray(data["feats"][sel]),
            jnp.asarray(data["tokens"][sel]),
            jnp.asarray(data["mask"][sel]),
            jnp.asarray(data["answer"][sel]),
            jax.random.key(args.seed * 100_003 + s),
        )
        met = {k: np.asarray(v).tolist() for k, v in met.items()}
        history.append(met)
        bar.set_postfix(loss=f"{met['loss']:.3f}", agree=" ".join(f"{a:.2f}" for a in met["agree_answer"]))
        if (s + 1) % args.ckpt_every == 0 or s + 1 == total:
            mgr.save(s + 1, args=ocp.args.StandardSave({"trainable": trainable, "opt": opt_state}))
            if from_step == 0:  # metrics of every step so far: a resume keeps the run's first ones
                RS.save_history(hist_path, s + 1, seconds_before + time.perf_counter() - t0, history)
    mgr.wait_until_finished()
    mgr.close()
    return ecfg, {**trainable, "token_ids": ids}, history, from_step, seconds_before + time.perf_counter() - t0


def training_summary(history: list[dict], from_step: int) -> dict:
    """The report's training metrics: mean loss over the first and the last tenth of ``history`` (the steps
    from ``from_step``), the last tenth's per-pass KL, smooth-L1 and in-sample agreement; None where no step is
    recorded (a checkpoint of the last step, made before the metrics were kept, and nothing left to run)."""
    k = max(len(history) // 10, 1)
    first, last = history[:k], history[-k:]

    def avg(h, key):
        return np.mean([x[key] for x in h], axis=0).tolist() if h else None

    return {
        "loss_start": avg(first, "loss"),
        "loss_end": avg(last, "loss"),
        "kl_end": avg(last, "kl"),
        "reg_end": avg(last, "reg"),
        "agree_end": avg(last, "agree"),
        "agree_answer_end": avg(last, "agree_answer"),
        "metrics_from_step": from_step,
        "metrics_steps": len(history),
    }


def summary_line(name: str, summary: dict) -> str:
    """``training_summary`` in words; metrics that cover only the steps after a resume say so."""
    if not summary["metrics_steps"]:
        return RS.no_metrics_line(name, summary["metrics_from_step"])
    since = RS.since_step(summary["metrics_from_step"])

    def r(v):
        return np.round(v, 3).tolist()

    return (
        f"{name}: loss{since} {summary['loss_start']:.3f} -> {summary['loss_end']:.3f} "
        f"({summary['metrics_steps']} steps); per pass: KL {r(summary['kl_end'])}, "
        f"smooth-L1 {r(summary['reg_end'])}, top-1 agreement (in-sample) {r(summary['agree_end'])}, "
        f"on answers {r(summary['agree_answer_end'])}"
    )


# ---- stage 5: evaluation ------------------------------------------------------------------------------


def teacher_forced_hits(
    target, ecfg, hp, prompts: list[list[int]], answers: list[list[int]], unroll: int = 3
) -> np.ndarray:
    """[U, n] bool, per pass u < ``unroll`` (the training run's ``--unroll``) and answer pair i (i >= P - 1, in
    order): ``head_unrolled`` pass u, teacher-forced on the target's own features of prompt + answer, puts its
    argmax on the answer's actual token x_{i+2}. hp: the head's params with ``rows``
    (``EagleDrafter.draft_params`` next to an unpacked target)."""
    cfg = target.config
    seqs = [list(p) + list(a) for p, a in zip(prompts, answers)]
    b, w = len(seqs), -(-max(len(s) for s in seqs) // 16) * 16
    toks = np.zeros((b, w), np.int32)
    for r, s in enumerate(seqs):
        toks[r, : len(s)] = s
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    _, raw, _ = EG.target_features(ecfg, target.params, jnp.asarray(toks), pos, llama.init_cache(cfg, b, w))
    feats = EG.fuse_features(ecfg, hp, raw)
    f_hat = EG.head_unrolled(ecfg, hp, target.params, feats[:, :-1], jnp.asarray(toks[:, 1:]), unroll)
    best = np.stack([np.asarray(jnp.argmax(EG.subset_logits(f_hat[u], hp["rows"]), -1)) for u in range(unroll)])
    pred = np.asarray(hp["token_ids"])[best]  # [U, B, w-1] token predicted for x_{i+2}
    hits = [np.zeros((unroll, 0), bool)]
    for r, s in enumerate(seqs):
        i = np.arange(len(prompts[r]) - 1, len(s) - 2)
        hits.append(pred[:, r, i] == toks[r, i + 2][None])
    return np.concatenate(hits, axis=1)


def teacher_forced_agreement(
    target, drafter, dparams, prompts: list[list[int]], answers: list[list[int]], unroll: int = 3
):
    """Per pass u < ``unroll``: the share of answer pairs at which pass u is right (``teacher_forced_hits``). The
    training computation on held-out text, against the full-vocabulary token (a token outside the draft
    vocabulary is a miss): for a greedy answer, pass 0 is the acceptance rate draft position 1 would have if a
    round started at every position."""
    hits = teacher_forced_hits(target, drafter.ecfg, dparams[1], prompts, answers, unroll)
    return (hits.sum(axis=1) / max(hits.shape[1], 1)).tolist()


def eval_numerics(target_params, head_params) -> dict:
    """What an evaluation computed with: ``evaluated_dtype``, the float dtypes of the head's own weights as the
    drafter read them (the LM-head rows it gathers from the target are the target's), and ``target_layout``:
    "stacked", "unstacked", or "packed" (the CPU kernel's layout, next to which the head's matrices are packed in
    bfloat16 by default)."""
    own = [x for k, v in head_params.items() if k not in ("token_ids", "rows") for x in jax.tree.leaves(v)]
    dtypes = sorted({jnp.dtype(x.dtype).name for x in own if jnp.issubdtype(x.dtype, jnp.floating)})
    tp = target_params
    layout = "packed" if llama.is_packed(tp) else "unstacked" if llama.is_unstacked(tp) else "stacked"
    return {"evaluated_dtype": "+".join(dtypes), "target_layout": layout}


def evaluate(target, path: str, gamma: int, max_new: int, seed: int = 0, unroll: int = 3) -> dict:
    """Acceptance per draft position on the held-out prompts, greedy and T = 1 (one decode each), and the
    teacher-forced agreement of the ``unroll`` training passes on the greedy answers
    (``teacher_forced_agreement``). Each row records what it computed with (``eval_numerics``): the saved head
    restored in the target's dtype (float32 here) on the target as loaded, not the bf16 ``--export``."""
    tok = target.tokenizer
    drafter, dparams = EG.load_eagle(path, target.config, target.params, max_draft=gamma)
    numerics = eval_numerics(dparams[0], dparams[1])
    ids = [encode(tok, p, 512) for p in EVAL_PROMPTS]
    res = {}
    for label, temp in (("greedy", 0.0), ("T=1", 1.0)):
        out = dec.decode(
            target.model,
            target.params,
            ids,
            drafter=drafter,
            draft_params=dparams,
            gamma=gamma,
            max_new_tokens=max_new,
            temperature=temp,
            eos_ids=tok.eos_ids,
            seed=seed,
        )
        st = out.stats
        res[label] = {
            "acceptance_rate": st["acceptance_rate"],
            "tokens_per_round": st["tokens_per_round"],
            "accepted_at": st["accepted_at"],
            "proposed_at": st["proposed_at"],
            "survival": [a / p if p else None for a, p in zip(st["accepted_at"], st["proposed_at"])],
            "conditional": conditional_rates_from_stats(st["accepted_at"], st["proposed_at"]).tolist(),
            "new_tokens": sum(st["new_tokens"]),
            # Share of held-out output inside the draft vocabulary (the rest can only come from the residual).
            "coverage": float(np.isin(np.concatenate(out.tokens), np.asarray(dparams[1]["token_ids"])).mean()),
            **numerics,
        }
        if temp == 0.0:
            res[label]["teacher_forced"] = teacher_forced_agreement(target, drafter, dparams, ids, out.tokens, unroll)
    return res


def print_eval(ev: dict, gamma: int):
    for label, r in ev.items():
        surv = " ".join(f"{x:.2f}" if x is not None else "-" for x in r["survival"])
        cond = " ".join(f"{x:.2f}" for x in r["conditional"])
        print(
            f"held-out {label:6s} K={gamma}: tokens/round {r['tokens_per_round']:.2f}, acceptance "
            f"{r['acceptance_rate']:.3f}; per position: accepted/proposed [{surv}], conditional [{cond}] "
            f"({r['new_tokens']} tokens, {100 * r.get('coverage', float('nan')):.1f}% inside the draft vocabulary)"
        )
        if "teacher_forced" in r:
            tf = " ".join(f"{x:.2f}" for x in r["teacher_forced"])
            print(f"held-out {label:6s} teacher-forced agreement per training pass on the answers: [{tf}]")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default=None, help="cache name (default: <model>-<N>)")
    ap.add_argument("--head-tokens", type=int, default=8192, help="frequent-token draft vocabulary N; 0 = all")
    ap.add_argument("--ffn", type=int, default=0, help="head layer FFN width (0: the target's)")
    ap.add_argument(
        "--head-layers",
        type=int,
        default=0,
        help="the head's decoder layers (0: one, or --init-from's); more than --init-from's grafts new layers "
        "on top that start as the identity",
    )
    ap.add_argument(
        "--fuse",
        default="",
        help="target layers whose outputs join f as the head's input, e.g. '2,15' (EAGLE-3 fusion; '' = none)",
    )
    ap.add_argument(
        "--init-from",
        default="",
        help="fine-tune this trained head (name or directory; same --head-tokens/--ffn/--fuse; its token map)",
    )
    ap.add_argument(
        "--remap",
        action="store_true",
        help="with --init-from: rebuild the frequent-token map from this run's data instead of keeping the head's",
    )
    ap.add_argument(
        "--gen-batches",
        default="14",
        help="target generation batches (the data budget): N for batches 0..N-1, or ranges like '0-11,32-51'",
    )
    ap.add_argument(
        "--self-batches",
        type=int,
        default=0,
        help="batches of requests the target writes itself (Magpie) and answers, next to --gen-batches",
    )
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=192)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.8, help="of the odd (sampled) generation batches")
    ap.add_argument("--feature-batch", type=int, default=8)
    ap.add_argument(
        "--doc-tokens", type=int, default=40000, help="off-policy stdlib docstrings + reference topics (0: none)"
    )
    ap.add_argument("--doc-width", type=int, default=256)
    ap.add_argument("--prompt-loss", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--unroll", type=int, default=3, help="training-time-test passes (draft steps trained)")
    ap.add_argument("--pass-decay", type=float, default=0.8)
    ap.add_argument("--ce-weight", type=float, default=0.5)
    ap.add_argument(
        "--reg-weight",
        type=float,
        default=1.0,
        help="weight of the feature regression; 0 trains on tokens alone, as EAGLE-3 does (f^ then is the "
        "head's own state, read through the target's LM-head rows)",
    )
    ap.add_argument("--noise", type=float, default=0.0, help="uniform noise on input features")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="override epochs")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--eval-max-new", type=int, default=64)
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--force", action="store_true", help="retrain even if a finished head is cached")
    ap.add_argument(
        "--export",
        default="",
        help="also write the finished head with bf16 weights to this directory (how models/heads/ is made)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        args.fuse = tuple(int(x) for x in args.fuse.split(",")) if args.fuse.strip() else ()
    except ValueError:
        ap.error(f"--fuse {args.fuse!r}: expected comma-separated layer indices such as '2,15'")
    if args.head_layers < 0:
        ap.error(f"--head-layers {args.head_layers}: expected 0 (one, or --init-from's) or more")
    # Counts that would fail (or train nothing) only after the target's data was generated: refused here.
    for flag, low in (
        ("self_batches", 0),
        ("gen_batch", 1),
        ("max_prompt", 1),
        ("max_new", 1),
        ("feature_batch", 1),
        ("window", 2),  # a window of w pairs holds w + 1 tokens; one of fewer than 3 is never kept
        ("unroll", 1),
        ("batch", 1),
        ("epochs", 1),
        ("steps", 0),
        ("warmup", 0),
        ("ckpt_every", 1),
        ("gamma", 1),
        ("eval_max_new", 1),
        ("head_tokens", 0),
        ("ffn", 0),
    ):
        if getattr(args, flag) < low:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected {low} or more")
    if args.doc_tokens > 0 and args.doc_width < 1:
        ap.error(f"--doc-width {args.doc_width}: expected 1 or more (or --doc-tokens 0)")
    try:
        gen_ids = batch_ids(args.gen_batches)
    except SystemExit as e:
        ap.error(str(e))
    if not gen_ids and not args.self_batches:
        ap.error(f"--gen-batches {args.gen_batches}: no generated data without --self-batches N")
    if args.name is None:
        n = args.head_tokens
        args.name = f"{args.model}-{f'{n // 1024}k' if n and n % 1024 == 0 else (n or 'full')}"
        if args.fuse:
            args.name += "-f" + "-".join(str(i) for i in args.fuse)
    return args


# Arguments that do not change the trained head: a cached head or checkpoint made with other values is the same.
_NOT_TRAINING = frozenset({"force", "export", "no_eval", "eval_max_new", "gamma", "name", "ckpt_every"})


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder


def _training_args(args_dict: dict) -> dict:
    return RS.settings(args_dict, _NOT_TRAINING)


def eval_settings(args) -> dict:
    """What the held-out evaluation depends on besides the head: a cached head whose report was made with other
    values is evaluated again (not retrained). ``unroll``: the teacher-forced passes measured."""
    return {
        "gamma": args.gamma,
        "eval_max_new": args.eval_max_new,
        "seed": args.seed,
        "unroll": args.unroll,
        "prompts": list(EVAL_PROMPTS),
    }


def recorded_eval_settings(report: dict) -> dict:
    """``eval_settings`` of a report's evaluation. A report made before they were recorded ran with its
    ``gamma`` and the arguments it records; its teacher-forced passes were 3 whatever ``--unroll`` was, and its
    prompts were not recorded (they are not compared)."""
    if "eval_settings" in report:
        return report["eval_settings"]
    a = report.get("args", {})
    return {"gamma": report.get("gamma"), **{k: a[k] for k in ("eval_max_new", "seed") if k in a}, "unroll": 3}


def stale_evaluation(report: dict, args) -> list[str]:
    """Why ``report``'s held-out evaluation is not the one this run would make: [] when it is, ["none"] when it
    has none, else the evaluation settings that differ (``eval_settings``)."""
    if not report.get("eval"):
        return ["none"]
    return RS.differences(recorded_eval_settings(report), eval_settings(args))


# Keys save_head adds to the report it keeps in the head's meta.json (the rest is the report, less "eval").
_HEAD_META = frozenset({"format", "kind", "config", "adapter_width", "head_tokens", "target"})


def cached_head(args, final: str, eval_path: str) -> dict:
    """A finished head under --name is never retrained (``--force`` does that): its report is eval.json, or
    for a head never evaluated (``--no-eval``, or a run that stopped during the evaluation) the training
    metrics its meta.json keeps. The evaluation runs (again) when there is none or it was made with other
    ``eval_settings``, unless ``--no-eval``; then it is printed and exported."""
    if os.path.isfile(eval_path):
        with open(eval_path) as f:
            report = json.load(f)
    else:
        with open(os.path.join(final, "meta.json")) as f:
            report = {k: v for k, v in json.load(f).items() if k not in _HEAD_META}
        report["eval"] = {}
    print(f"cached head at {final} (--force retrains)")
    stale = stale_evaluation(report, args)
    if stale and not args.no_eval:
        why = "it was never evaluated" if stale == ["none"] else f"evaluation settings changed: {', '.join(stale)}"
        print(f"evaluating it ({why})")
        target = registry.load(args.model, dtype="float32")
        report["eval"] = evaluate(target, final, args.gamma, args.eval_max_new, args.seed, args.unroll)
        report["gamma"], report["eval_settings"] = args.gamma, eval_settings(args)
        with open(eval_path, "w") as f:
            json.dump(report, f, indent=1)
    elif stale and stale != ["none"]:
        print(f"(evaluated with other settings: {', '.join(stale)}; --no-eval does not evaluate it again)")
    if report["eval"]:
        print_eval(report["eval"], report["gamma"])
    else:
        print("not evaluated (--no-eval)")
    export(args, final, report)
    return report


def check_same_run(args, out_dir: str, eval_path: str) -> None:
    """A head or checkpoint under ``out_dir`` made with other training settings is refused by name (it was
    reused as this run's result, or resumed on a new schedule); a directory with neither (fresh, or left by a
    run that stopped before its first checkpoint, whose ``ckpt/`` the checkpoint manager made empty) records
    this run's settings instead."""

    def unrecorded():  # made before args.json existed: its report has the arguments
        if not os.path.isfile(eval_path):
            return None
        with open(eval_path) as f:
            return _training_args(json.load(f).get("args", {}))

    RS.check_same_run(
        _training_args(vars(args)),
        os.path.join(out_dir, "args.json"),
        os.path.isdir(os.path.join(out_dir, "head")) or RS.has_checkpoint(os.path.join(out_dir, "ckpt")),
        holder=f"{out_dir} holds a head trained",
        remedy="give this run another --name, or --force to retrain",
        unrecorded=unrecorded,
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.remap and not args.init_from:
        raise SystemExit("--remap rebuilds a fine-tuned head's token map: it needs --init-from")
    out_dir = os.path.join(EG.cache_root(), args.name)
    final = os.path.join(out_dir, "head")
    eval_path = os.path.join(out_dir, "eval.json")
    if args.force and os.path.isdir(out_dir):
        if args.init_from and _inside(EG.resolve_head(args.init_from), out_dir):
            raise SystemExit(
                f"--force would delete {out_dir}, which holds the head --init-from {args.init_from} names: "
                "give this run another --name"
            )
        shutil.rmtree(out_dir)  # the target data (data_dir) is kept
    check_same_run(args, out_dir, eval_path)
    if os.path.isfile(os.path.join(final, "meta.json")):  # save_head writes it last: the head is finished
        return cached_head(args, final, eval_path)

    t0 = time.perf_counter()
    target = registry.load(args.model, dtype="float32")
    try:  # bad --fuse layers or --head-layers are refused before any model call
        EG.EagleConfig(target.config, args.head_tokens, args.ffn, fuse=args.fuse, layers=args.head_layers or 1)
    except ValueError as e:
        raise SystemExit(f"--fuse / --head-layers: {e}") from None
    if args.init_from:  # so is a head to fine-tune that does not fit this run
        init_source(args, target.config)
    # The target's text and features come from the CPU decode layout (per-layer weights on the CPU kernels,
    # ~2x faster there); training reads the stacked params.
    gen = target._replace(params=llama.unstack_layers(target.params)) if jax.default_backend() == "cpu" else target
    files = generate_data(args, gen, data_dir(args)) + generate_self_data(args, gen, data_dir(args))
    if not files:
        raise SystemExit("no generated data: --gen-batches none needs --self-batches N")
    doc_dir = os.path.join(EG.cache_root(), "_data", f"{args.model}-docs-w{args.doc_width}-s{args.seed}")
    doc_files = generate_doc_data(args, gen, doc_dir)
    extra = layer_files(args, gen, files + doc_files)
    del gen
    data, answers = load_windows(files + doc_files, args.window, args.prompt_loss, extra)
    answers = answers[: len(files) * args.gen_batch]  # the generated answers only (the frequent-token map)
    t_data = time.perf_counter() - t0
    n_ans = int(sum(len(a) for a in answers))
    print(
        f"data: {n_ans} generated tokens in {len(files)} batches + {len(doc_files)} docstring files; "
        f"{int(data['mask'].sum())} trained pairs"
    )
    token_ids = draft_vocabulary(args, answers, target.config.vocab_size, target.tokenizer.eos_ids)

    # A run resumed from a checkpoint of the last step makes no step: its metrics and seconds are those kept
    # with the checkpoint (train), not NaN and ~0 s.
    ecfg, hp, history, from_step, t_train = train(args, target, data, token_ids, out_dir)
    summary = training_summary(history, from_step)
    print(f"trained {summary_line(args.name, summary)}; data {t_data:.0f} s, training {t_train:.0f} s")
    report = {
        "name": args.name,
        "gamma": args.gamma,
        "data_seconds": t_data,
        "train_seconds": t_train,
        "generated_tokens": n_ans,
        **summary,
        "args": vars(args),
        "eval": {},
    }
    EG.save_head(final, ecfg, hp, {k_: v_ for k_, v_ in report.items() if k_ != "eval"})
    if not args.no_eval:
        report["eval"] = evaluate(target, final, args.gamma, args.eval_max_new, args.seed, args.unroll)
        report["eval_settings"] = eval_settings(args)
        print_eval(report["eval"], args.gamma)
        with open(eval_path, "w") as f:
            json.dump(report, f, indent=1)
    print(f"total {time.perf_counter() - t0:.0f} s; head saved to {final}")
    export(args, final, report)
    return report


EXPORT_DTYPE = "bfloat16"


def export(args, final: str, report: dict) -> None:
    """``--export DIR``: the head in bf16 with its held-out evaluation and the settings it ran with
    (``eval_settings``) in meta.json (``models.eagle.export_head``), and what that evaluation computed with next to
    the export's ``stored_dtype``: ``evaluated_dtype`` and ``evaluated_layout`` (``eval_numerics``; "not
    recorded" for an evaluation made before they were), with ``eval_note`` saying the bf16 rounding was not what
    was evaluated when the two differ."""
    if not args.export:
        return
    extra = {"eval": report.get("eval", {})}
    if extra["eval"]:
        extra["eval_settings"] = recorded_eval_settings(report)
        row = next(iter(extra["eval"].values()))
        dtype = row.get("evaluated_dtype", "not recorded")
        extra.update(evaluated_dtype=dtype, evaluated_layout=row.get("target_layout", "not recorded"))
        if dtype != EXPORT_DTYPE:
            extra["eval_note"] = (
                f"the held-out metrics were measured with the head's weights in {dtype} on a "
                f"{extra['evaluated_layout']} target, before the export stored them in {EXPORT_DTYPE}: the exported "
                "head's rounding was not evaluated"
            )
    out = EG.export_head(final, args.export, dtype=EXPORT_DTYPE, extra_meta=extra)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"exported (bf16) to {out}: {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
