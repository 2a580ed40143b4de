"""`moepack trace`: which experts a prompt routes to, and what that means for caching them.

The model is run greedily with the prompt fed one token per forward call, so every token's routing is seen
(decode routing is per token anyway). The expert reader's recorder (``ExpertReader.recorder``) records each
read request's (layer, expert ids); the analysis then works on ``routing[token][layer] -> expert ids`` only,
so it is checkable by hand:

* frequency: per layer, how many tokens each expert served;
* overlap: per layer, the mean over consecutive token pairs of |S_t & S_t-1| / |S_t|;
* LRU: per layer, the hit rate a least-recently-used cache of C experts (per layer) would have had, the
  experts of one token looked up in ascending id order, misses inserted (the least recently used evicted);
* residency (after the run): per layer, the fraction of expert record pages in the OS page cache (mincore),
  over all experts and over the experts the run used.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from .errors import MoepackError

Routing = list[dict[int, list[int]]]  # per token: layer -> sorted expert ids


# ------------------------------------------------------------------------------------------------ analysis


def default_capacities(num_experts: int) -> list[int]:
    """32, 64, 128, ... below `num_experts`; for small models the powers of two below it."""
    caps = [c for c in (32 << i for i in range(12)) if c < num_experts]
    return caps or [1 << i for i in range(max(1, (num_experts - 1).bit_length())) if (1 << i) < num_experts]


def layers_of(routing: Routing) -> list[int]:
    return sorted({lay for tok in routing for lay in tok})


def expert_frequency(routing: Routing, num_experts: int) -> dict[int, np.ndarray]:
    """layer -> int [num_experts]: tokens routed to each expert."""
    out = {}
    for lay in layers_of(routing):
        c = np.zeros(num_experts, dtype=np.int64)
        for tok in routing:
            c[tok.get(lay, [])] += 1
        out[lay] = c
    return out


def consecutive_overlap(routing: Routing) -> dict[int, float | None]:
    """layer -> mean over t >= 1 of |S_t & S_t-1| / |S_t| (None with fewer than two tokens)."""
    out = {}
    for lay in layers_of(routing):
        sets = [set(tok[lay]) for tok in routing if lay in tok]
        fr = [len(b & a) / len(b) for a, b in zip(sets[:-1], sets[1:]) if b]
        out[lay] = float(np.mean(fr)) if fr else None
    return out


def lru_hit_rate(sequence: list[list[int]], capacity: int) -> float:
    """Hits / lookups of an LRU cache of `capacity` entries over per-token expert lists (ascending order)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = lookups = 0
    for experts in sequence:
        for e in sorted(experts):
            lookups += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / lookups if lookups else 0.0


def lru_hit_rates(routing: Routing, capacities) -> dict[int, dict[int, float]]:
    """layer -> {capacity: hit rate}."""
    return {lay: {c: lru_hit_rate([tok[lay] for tok in routing if lay in tok], c) for c in capacities}
            for lay in layers_of(routing)}


def analyse(routing: Routing, num_experts: int, capacities=None) -> dict:
    """Everything `moepack trace` reports except residency, JSON-ready."""
    caps = list(capacities) if capacities is not None else default_capacities(num_experts)
    freq = expert_frequency(routing, num_experts)
    ovl = consecutive_overlap(routing)
    lru = lru_hit_rates(routing, caps)
    layers = []
    for lay in layers_of(routing):
        c = freq[lay]
        used = int((c > 0).sum())
        top = np.argsort(-c, kind="stable")[:5]
        layers.append({"layer": lay, "distinct_experts": used, "lookups": int(c.sum()),
                       "top_experts": [[int(e), int(c[e])] for e in top if c[e] > 0],
                       "frequency": c.tolist(), "overlap": ovl[lay],
                       "lru_hit_rate": {str(k): v for k, v in lru[lay].items()}})
    ov = [x["overlap"] for x in layers if x["overlap"] is not None]
    mean_lru = {str(c): float(np.mean([lru[lay][c] for lay in lru])) if lru else 0.0 for c in caps}
    return {"tokens": len(routing), "num_experts": num_experts, "capacities": caps, "layers": layers,
            "mean_overlap": float(np.mean(ov)) if ov else None, "mean_lru_hit_rate": mean_lru}


# ------------------------------------------------------------------------------------------------ recording


class RoutingRecorder:
    """Attach to an ExpertReader (``reader.recorder = rec``); call ``rec.next_token()`` before each forward
    call of one token. Requests of one layer within one token (prefill batches) are merged."""

    def __init__(self):
        self.routing: Routing = []

    def next_token(self) -> None:
        self.routing.append({})

    def __call__(self, layer: int, experts) -> None:
        if not self.routing:
            self.next_token()
        tok = self.routing[-1]
        tok[layer] = sorted(set(tok.get(layer, [])) | {int(e) for e in experts})


def residency(packed_model, used: dict[int, set[int]] | None = None) -> list[dict]:
    """Per layer: fraction of record pages resident in the page cache, over all experts and over `used`."""
    from .runtime.residency import FileMap

    out = []
    for entry in packed_model.manifest.layers:
        size = packed_model.layout(entry.layer).record_size
        with FileMap(packed_model.path / entry.file) as fm:
            vec = fm.resident()
        per_page = size // fm.page_size if size % fm.page_size == 0 else None
        row = {"layer": entry.layer, "resident_fraction": float(vec.mean()) if vec.size else 0.0}
        if per_page:
            per_rec = vec[: per_page * packed_model.manifest.moe.num_experts].reshape(-1, per_page).mean(axis=1)
            row["records_fully_resident"] = int((per_rec == 1).sum())
            row["records_partly_resident"] = int(((per_rec > 0) & (per_rec < 1)).sum())
            u = sorted((used or {}).get(entry.layer, ()))
            row["used_resident_fraction"] = float(per_rec[u].mean()) if u else None
        out.append(row)
    return out


def run_trace(packed, *, prompt: str | None = None, prompt_ids=None, max_tokens: int = 32, backend: str = "auto",
              io: str = "pread", raw: bool = False, capacities=None, progress: bool = False) -> dict:
    """`moepack trace`: run the prompt (one token per forward call) and greedy decode; analyse the routing."""
    from .runtime.generate import check_ids, generate, open_model, parse_ids
    from .runtime.tokenizer import load_tokenizer

    if (prompt is None) == (prompt_ids is None):
        raise MoepackError("pass exactly one of --prompt and --prompt-ids", hint='e.g. --prompt "Hello"')
    if max_tokens < 0:
        raise MoepackError(f"--max-tokens must be >= 0, got {max_tokens}")
    tokenizer = load_tokenizer(packed, required=prompt is not None)
    with open_model(packed, backend=backend, io=io) as model:
        if prompt is not None:
            ids = (tokenizer.encode(prompt) if raw or tokenizer.chat_template is None
                   else tokenizer.encode_chat([{"role": "user", "content": prompt}]))
        else:
            ids = parse_ids(prompt_ids) if isinstance(prompt_ids, str) else list(prompt_ids)
        ids = check_ids(ids, model.vocab_size)
        rec = RoutingRecorder()
        model.reader.recorder = rec
        forward = model.forward

        def traced_forward(x, cache):  # a new token starts at each call (prefill fed one token per call)
            rec.next_token()
            return forward(x, cache)

        model.forward = traced_forward
        try:
            g = generate(model, ids, tokenizer=tokenizer, max_tokens=max_tokens, temperature=0.0, prefill_chunk=1)
        finally:
            model.forward = forward
            model.reader.recorder = None
        n_exp = model.manifest.moe.num_experts
        res = analyse(rec.routing, n_exp, capacities)
        used: dict[int, set[int]] = {}
        for tok in rec.routing:
            for lay, ex in tok.items():
                used.setdefault(lay, set()).update(ex)
        res["residency"] = residency(model.packed, used)
        res["experts_per_token"] = model.experts_per_token
        res["prompt_tokens"] = len(ids)
        res["generated_tokens"] = len(g.tokens)
        res["generated"] = list(g.tokens)
        ph = g.stats["phases"]
        res["experts_read"] = ph["prefill"]["experts_read"] + ph["decode"]["experts_read"]  # the runtime's count
        res["text"] = g.text
        res["io"] = model.reader.io
    res["packed"] = str(packed)
    return res


# ------------------------------------------------------------------------------------------------ output


def report(res: dict) -> str:
    caps = res["capacities"]
    lines = [f"routing of {res['tokens']} tokens ({res['prompt_tokens']} of the prompt, then generated ones fed "
             f"back; {res['generated_tokens']} generated), K={res['experts_per_token']} of {res['num_experts']} "
             "experts",
             f"{'layer':>5}{'distinct':>9}{'overlap':>9}" + "".join(f"{'LRU' + str(c):>9}" for c in caps)
             + f"{'cached':>8}{'used$':>7}  top experts (tokens)"]
    res_by_layer = {r["layer"]: r for r in res.get("residency", [])}
    for x in res["layers"]:
        r = res_by_layer.get(x["layer"], {})
        ov = "-" if x["overlap"] is None else f"{x['overlap'] * 100:.0f}%"
        used = r.get("used_resident_fraction")
        lines.append(f"{x['layer']:>5}{x['distinct_experts']:>9}{ov:>9}"
                     + "".join(f"{x['lru_hit_rate'][str(c)] * 100:>8.0f}%" for c in caps)
                     + f"{r.get('resident_fraction', 0) * 100:>7.0f}%"
                     + ("      -" if used is None else f"{used * 100:>6.0f}%")
                     + "  " + " ".join(f"{e}({n})" for e, n in x["top_experts"]))
    mo = res["mean_overlap"]
    lines.append(f"{'mean':>5}{'':>9}{'-' if mo is None else f'{mo * 100:.0f}%':>9}"
                 + "".join(f"{res['mean_lru_hit_rate'][str(c)] * 100:>8.0f}%" for c in caps))
    lines.append("overlap: share of a token's experts the previous token also used; LRUc: hit rate of an LRU cache "
                 "of c experts per layer; cached: page-cache residency of the layer file after the run (used$: of "
                 "the experts this run used)")
    return "\n".join(lines)


def plot(res: dict, path: str | Path) -> None:
    """Three panels: expert frequency heatmap (layers x experts), overlap per layer, LRU hit rate vs capacity."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MoepackError("--plot needs matplotlib", hint="pip install 'moepack[plot]'") from None
    layers = [x["layer"] for x in res["layers"]]
    freq = np.array([x["frequency"] for x in res["layers"]], dtype=float)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    im = ax[0].imshow(freq, aspect="auto", interpolation="nearest", cmap="viridis")
    ax[0].set_xlabel("expert")
    ax[0].set_ylabel("layer")
    step = max(1, len(layers) // 16)
    ax[0].set_yticks(range(0, len(layers), step), [str(v) for v in layers[::step]])
    ax[0].set_title("tokens routed to each expert")
    fig.colorbar(im, ax=ax[0])
    ax[1].bar(layers, [100 * (x["overlap"] or 0) for x in res["layers"]])
    ax[1].set_xlabel("layer")
    ax[1].xaxis.get_major_locator().set_params(integer=True)
    ax[1].set_ylabel("% of experts shared with the previous token")
    ax[1].set_title("consecutive-token overlap")
    caps = res["capacities"]
    for x in res["layers"]:
        ax[2].plot(caps, [100 * x["lru_hit_rate"][str(c)] for c in caps], color="0.75", lw=0.8)
    ax[2].plot(caps, [100 * res["mean_lru_hit_rate"][str(c)] for c in caps], color="C3", lw=2, marker="o",
               label="mean over layers")
    ax[2].set_xscale("log", base=2)
    ax[2].set_xlabel("LRU capacity (experts per layer)")
    ax[2].set_ylabel("hit rate %")
    ax[2].set_title("LRU expert cache hit rate")
    ax[2].legend()
    for a in ax[1:]:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
