"""The layout sweep's cases: a fixed list of anchors, then a deterministic draw over the axes.

Axes (each case one value of each):

    model        (H, I) and its top-k: qwen3-30b-a3b (2048, 768) top-8; qwen3-235b-a22b (4096, 1536)
                 top-1 and top-8; llama4 (5120, 8192) top-1; kimi-k2 (7168, 2048) top-8;
                 h7168-i4096 (7168, 4096) top-1 and top-8. Top-1 puts the router weight on the
                 input (Llama-4 style: route_weights None)
    experts      E = 4, 16, 60, 128, 256, 384 or 996; G = E + 4 prefetch slots (8 to 1000); only
                 where the three [G, ., .] weight tensors fit in WEIGHT_CAP_BYTES (64 GiB), so
                 G = 1000 on the two smaller models
    epn          the block of experts that receives tokens: all E (EP1) or E / 8 (EP8), at least K
    tokens       S = 16, 32, 64, 128 (decode) ... 4096, 8192 (prefill)
    skew         Zipf exponent of expert popularity: 0 (uniform), 0.8, 1.5
    padding      segments padded to 128 rows (MoonEP) or not (1)
    seed         0, 1, 2: the popularity order and the routing draw

The draw is stratified: models take turns, and for each model every axis deals its values from a
shuffled deck (all values once before any repeats), so each model sees every value of every axis
that fits it. Seeded (``CASE_SEED``): the same list on every run, so runs are comparable case by case.
No torch needed to list the cases.
"""

import dataclasses
import random
import re

CASE_SEED = 0
NUM_PREFETCH = 4
WEIGHT_CAP_BYTES = 64 * 2 ** 30


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    inter: int
    topks: tuple


MODELS = (
    Model("qwen3-30b-a3b", 2048, 768, (8,)),
    Model("qwen3-235b-a22b", 4096, 1536, (1, 8)),
    Model("llama4", 5120, 8192, (1,)),
    Model("kimi-k2", 7168, 2048, (8,)),
    Model("h7168-i4096", 7168, 4096, (1, 8)),
)
EXPERTS = (4, 16, 60, 128, 256, 384, 996)
TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SKEWS = (0.0, 0.8, 1.5)
PADDINGS = (128, 1)
SEEDS = (0, 1, 2)


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    hidden: int
    inter: int
    topk: int
    experts: int  # E; G = E + NUM_PREFETCH
    epn: int  # experts that receive tokens, a block of E
    tokens: int  # S
    skew: float
    token_padding: int
    seed: int

    @property
    def groups(self) -> int:
        return self.experts + NUM_PREFETCH

    @property
    def name(self) -> str:
        return (f"{self.model} K{self.topk} G{self.groups} epn{self.epn} S{self.tokens} "
                f"z{self.skew:g} p{self.token_padding} s{self.seed}")

    def shape(self):
        """The :class:`benchmarks.shapes.Shape` that ``build_problem`` lays out for this case."""
        from .shapes import Shape

        return Shape(self.name, self.hidden, self.inter, self.groups, self.topk, self.tokens, self.epn,
                     active=min(self.groups, self.epn + NUM_PREFETCH), weights_on_input=self.topk == 1)


# Edge cases that every run starts with (and all that --quick runs): G = 1000 at decode with
# mostly padding and at a skewed unpadded prefill, G = 8 at top-1 decode, a long compute-bound
# prefill, a skewed unpadded top-1 middle size.
ANCHORS = (
    Case("qwen3-30b-a3b", 2048, 768, 8, 996, 996, 64, 0.8, 128, 0),
    Case("qwen3-235b-a22b", 4096, 1536, 8, 996, 124, 4096, 1.5, 1, 1),
    Case("llama4", 5120, 8192, 1, 4, 4, 16, 0.0, 128, 2),
    Case("kimi-k2", 7168, 2048, 8, 384, 48, 8192, 0.8, 128, 0),
    Case("h7168-i4096", 7168, 4096, 1, 60, 60, 1024, 1.5, 1, 1),
)


def weights_fit(model: Model, experts: int) -> bool:
    """Whether the gate, up and down weights of ``experts + NUM_PREFETCH`` groups fit the cap."""
    return 3 * (experts + NUM_PREFETCH) * model.hidden * model.inter * 2 <= WEIGHT_CAP_BYTES


def epn_choices(experts: int, topk: int) -> tuple:
    """EP1 (all ``experts``) and EP8 (an eighth), keeping those with at least ``topk`` experts."""
    return tuple(sorted({e for e in (experts, experts // 8) if e >= topk}, reverse=True))


class _Decks:
    """Per key, a shuffled deck of values, dealt one at a time and reshuffled when empty."""

    def __init__(self, rng: random.Random):
        self.rng, self.decks = rng, {}

    def deal(self, key, values):
        deck = self.decks.setdefault(key, [])
        if not deck:
            deck.extend(self.rng.sample(list(values), len(values)))
        return deck.pop()


def drawn_cases(count: int, seed: int = CASE_SEED) -> list:
    """``count`` cases of the stratified draw (the anchors are not among them)."""
    decks = _Decks(random.Random(seed))
    cases = []
    for n in range(count):
        m = MODELS[n % len(MODELS)]
        topk = decks.deal(("topk", m.name), m.topks)
        experts = decks.deal(("experts", m.name, topk),
                             [e for e in EXPERTS if weights_fit(m, e) and epn_choices(e, topk)])
        epn = decks.deal(("epn", m.name, experts, topk), epn_choices(experts, topk))
        cases.append(Case(m.name, m.hidden, m.inter, topk, experts, epn,
                          tokens=decks.deal(("tokens", m.name), TOKENS),
                          skew=decks.deal(("skew", m.name), SKEWS),
                          token_padding=decks.deal(("padding", m.name), PADDINGS),
                          seed=decks.deal(("seed", m.name), SEEDS)))
    return cases


_NAME = re.compile(r"(\S+) K(\d+) G(\d+) epn(\d+) S(\d+) z([0-9.]+) p(\d+) s(\d+)")


def case_from_name(name: str) -> Case:
    """The case that ``name`` (:attr:`Case.name`) describes, from any draw's list or none: a
    layout of the held-out list (``--case-seed``) is named as one of the default list is."""
    match = _NAME.fullmatch(name.strip())
    models = {m.name: m for m in MODELS}
    if match is None or match[1] not in models:
        raise ValueError(f"not a layout-sweep case name: {name!r} (e.g. {ANCHORS[0].name!r}; models: "
                         f"{', '.join(models)})")
    m = models[match[1]]
    topk, groups, epn, tokens, padding, seed = (int(match[i]) for i in (2, 3, 4, 5, 7, 8))
    case = Case(m.name, m.hidden, m.inter, topk, groups - NUM_PREFETCH, epn, tokens, float(match[6]), padding, seed)
    if case.name != name.strip() or not 1 <= topk <= epn <= case.experts or padding < 1:
        raise ValueError(f"not a layout-sweep case name: {name!r} (a case needs 1 <= K <= epn <= G - "
                         f"{NUM_PREFETCH} and a padding of at least 1, written as {ANCHORS[0].name!r} is)")
    return case


def sweep_cases(count: int, quick: bool = False, seed: int = CASE_SEED) -> list:
    """The sweep's list: the anchors, then drawn cases up to ``count`` in all (``quick``: anchors
    only), drawn with ``seed`` (another than ``CASE_SEED``: a held-out list that no config rule was
    measured on)."""
    if quick:
        return list(ANCHORS)
    return list(ANCHORS) + drawn_cases(max(0, count - len(ANCHORS)), seed)
