"""The seeded synthetic workload generator: shared system prompts, trust groups, n > 1 and priorities."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError
from .distributions import ArrivalProcess, IntDist, _arrivals, _as_dist, _rng
from .requests import DEFAULT_TRUST_GROUP, TOKEN_ID_LIMIT, Prompt, SimRequest, _by_arrival, _check_int, _is_int

# ---- synthetic workloads -----------------------------------------------------------------------


def _group_names(trust_groups: int | Sequence[str]) -> list[str]:
    if _is_int(trust_groups):
        _check_int(trust_groups, "trust_groups", 1)
        return [DEFAULT_TRUST_GROUP] if trust_groups == 1 else [f"group-{i}" for i in range(trust_groups)]
    names = list(trust_groups)
    if not names or not all(isinstance(g, str) and g for g in names):
        raise ConfigError(f"trust_groups must be a positive count or non-empty names, got {trust_groups!r}")
    return names


def synthetic(
    count: int,
    *,
    arrivals: ArrivalProcess | Sequence[float],
    prompt_len: IntDist | int,
    output_len: IntDist | int,
    system_prompts: int = 0,
    system_prompt_len: int = 0,
    shared_fraction: float = 0.0,
    trust_groups: int | Sequence[str] = 1,
    n: IntDist | int = 1,
    priority: IntDist | int = 0,
    seed: int = 0,
    id_prefix: str = "syn-",
    token_base: int = 0,
) -> list[SimRequest]:
    """Generate `count` requests, deterministically for a given `seed`.

    A fraction `shared_fraction` of requests starts with one of `system_prompts` shared system
    prompts (chosen uniformly) of `system_prompt_len` tokens; `prompt_len` is the length of the
    request's own part after it, whose token ids are unique to the request. System prompts use the
    same token ids in every trust group: only the ledger's trust isolation keeps them apart.
    Requests go to the trust groups uniformly at random; `n` and `priority` are drawn per request.
    Each aspect draws from its own seeded stream, so changing one leaves the others unchanged.
    """
    _check_int(count, "count", 0)
    _check_int(system_prompts, "system_prompts", 0)
    _check_int(system_prompt_len, "system_prompt_len", 0)
    _check_int(token_base, "token_base", 0)
    if not (isinstance(shared_fraction, int | float) and 0 <= shared_fraction <= 1):
        raise ConfigError(f"shared_fraction must be in [0, 1], got {shared_fraction!r}")
    if shared_fraction > 0 and (system_prompts == 0 or system_prompt_len == 0):
        raise ConfigError("shared_fraction > 0 needs system_prompts >= 1 and system_prompt_len >= 1")
    len_dist, out_dist = _as_dist(prompt_len, "prompt_len"), _as_dist(output_len, "output_len")
    n_dist, prio_dist = _as_dist(n, "n"), _as_dist(priority, "priority")
    groups = _group_names(trust_groups)

    times = _arrivals(arrivals, count, _rng(seed, "arrivals"))
    r_len, r_out, r_share = _rng(seed, "prompt_len"), _rng(seed, "output_len"), _rng(seed, "sharing")
    r_group, r_n, r_prio = _rng(seed, "groups"), _rng(seed, "n"), _rng(seed, "priority")
    next_id = token_base + system_prompts * system_prompt_len  # system prompt k: [base + k*L, base + (k+1)*L)
    out = []
    for i in range(count):
        runs = []
        if shared_fraction and r_share.random() < shared_fraction:
            k = r_share.randrange(system_prompts)
            runs.append((token_base + k * system_prompt_len, system_prompt_len))
        own = len_dist.sample(r_len)
        if own < 0 or (own == 0 and not runs):
            raise ConfigError(f"prompt_len distribution gave {own} tokens for a request "
                              "without a system prompt")
        if own:
            runs.append((next_id, own))
            next_id += own
        if next_id > TOKEN_ID_LIMIT:
            raise ConfigError(f"synthetic token ids would exceed {TOKEN_ID_LIMIT - 1}; "
                              "use fewer or shorter prompts")
        out.append(SimRequest(
            f"{id_prefix}{i}", times[i], Prompt(runs), out_dist.sample(r_out),
            groups[r_group.randrange(len(groups))], n_dist.sample(r_n), prio_dist.sample(r_prio),
        ))
    return _by_arrival(out)


__all__ = ["synthetic"]
