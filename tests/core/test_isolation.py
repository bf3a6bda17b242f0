"""Tenant isolation under an adversarial workload: trust groups that replay each other's exact prompts
must never hit, share, observe or count each other's blocks. Block size 16; ``check()`` after every
operation."""

from __future__ import annotations

import random
from collections import defaultdict

from kvledger.core.identity import CacheContext, chain_digests, token_bytes
from kvledger.core.ledger import KVLedger, Request
from kvledger.core.observe import EventLog

BS = 16
GROUPS = [f"tenant-{i:02d}" for i in range(1, 13)]


def ctx(group: str) -> CacheContext:
    return CacheContext(trust_group=group, model="m", revision="r1")


def audit(ledger: KVLedger) -> None:
    ledger.check()
    u = ledger.usage()
    assert u.free + u.active + u.retained == u.total
    assert u.promised <= u.free + u.evictable
    # No block is ever in the tables of two groups at once, and an indexed block is its holders' group's.
    holders: dict[int, set[str]] = defaultdict(set)
    for rid in ledger.sequences():
        seq = ledger.sequence(rid)
        for b in seq.table.blocks:
            holders[b].add(seq.context.trust_group)
    for b, groups in holders.items():
        assert len(groups) == 1, f"block {b} is held by groups {sorted(groups)}"
        owner = ledger.pool.group[b]
        assert owner is None or {owner} == groups, f"block {b} of {owner!r} is held by {sorted(groups)}"


class Tenants:
    """Drives the workload and keeps an independent model of what each group may hit."""

    def __init__(self, ledger: KVLedger, events: EventLog) -> None:
        self.ledger = ledger
        self.events = events
        # Full-block prefixes each group stored, and who stored each prefix.
        self.prefixes: dict[str, set[tuple[int, ...]]] = defaultdict(set)
        self.owner_of: dict[tuple[int, ...], set[str]] = defaultdict(set)
        self.digests: dict[str, set[str]] = defaultdict(set)  # every digest a group's prompts can produce
        self.expected: dict[str, dict[str, int]] = defaultdict(
            lambda: {"queries": 0, "query_blocks": 0, "hit_blocks": 0, "query_tokens": 0, "hit_tokens": 0})
        self.cross_only = 0  # admissions whose prefix was cached only by other groups
        self.n = 0

    def expected_hits(self, group: str, prompt: list[int]) -> int:
        k = 0
        while (k + 1) * BS <= len(prompt) and tuple(prompt[: (k + 1) * BS]) in self.prefixes[group]:
            k += 1
        return k

    def others_have(self, group: str, prompt: list[int]) -> bool:
        return len(prompt) >= BS and bool(self.owner_of[tuple(prompt[:BS])] - {group})

    def admit(self, group: str, prompt: list[int], *, branches: int = 1, max_new: int = 4) -> str:
        self.n += 1
        rid = f"{group}:{self.n}"
        hits = self.expected_hits(group, prompt)
        if hits == 0 and self.others_have(group, prompt):
            self.cross_only += 1
        d = self.ledger.admit(Request(rid, prompt, max_new, ctx(group), branches=branches))
        audit(self.ledger)
        assert d.admitted, d.reason
        assert d.blocks_hit == hits, f"{rid}: {d.blocks_hit} hits, only {hits} from its own group"
        assert d.blocks_hit_pending == 0  # the model computes every prompt right after admission
        full = len(prompt) // BS
        e = self.expected[group]
        e["queries"] += 1
        e["query_blocks"] += full
        e["hit_blocks"] += hits
        e["query_tokens"] += len(prompt)
        e["hit_tokens"] += hits * BS
        for k in range(1, full + 1):
            self.prefixes[group].add(tuple(prompt[: k * BS]))
            self.owner_of[tuple(prompt[: k * BS])].add(group)
        self.digests[group].update(
            d.hex() for d in chain_digests(ctx(group).root_digest(), token_bytes(prompt), BS))
        self.ledger.mark_computed(rid, len(prompt))
        audit(self.ledger)
        return rid

    def finish(self, rid: str) -> None:
        for r in [r for r in self.ledger.sequences() if r == rid or r.startswith(rid + "/")]:
            self.ledger.release(r)
            audit(self.ledger)

    def check_views(self) -> None:
        all_digests = {e.digest for e in self.events.all() if e.digest is not None}
        seen: dict[str, str] = {}
        for group in GROUPS:
            view = self.events.view(group)
            assert all(e.trust_group == group for e in view)
            for e in view:
                if e.digest is not None:
                    assert e.digest in self.digests[group], f"{group} sees a digest it never produced"
                    owner = seen.setdefault(e.digest, group)
                    assert owner == group, f"a digest is in the views of {group} and {owner}"
        assert set(seen) == all_digests  # every digest event belongs to exactly one tenant's view
        for group in GROUPS:
            stats = self.ledger.tenant_stats(group)
            e = self.expected[group]
            rate = e["hit_tokens"] / e["query_tokens"] if e["query_tokens"] else 0.0
            none = {"queries": 0, "query_blocks": 0, "hit_blocks": 0, "query_tokens": 0, "hit_tokens": 0,
                    "hit_rate": 0.0}
            assert stats == {"trust_group": group, "prefix_cache": {**e, "hit_rate": rate},
                             "prefix_cache_readmissions": none}
            text = str(stats)
            assert not any(other in text for other in GROUPS if other != group)
            index_hex = {d.hex() for d in self.ledger.pool.index}
            assert not any(d in text for d in all_digests | index_hex)
            assert not any(d[:16] in text for d in all_digests | index_hex)
        operator = str(self.ledger.stats())
        assert not any(d in operator for d in all_digests)


def test_adversarial_tenants_never_share_hit_or_see_each_other() -> None:
    rng = random.Random(20240611)
    events = EventLog()
    ledger = KVLedger(4096, BS, events=events)
    tenants = Tenants(ledger, events)
    # Popular prompts every tenant will try, and each tenant's own recent prompts for others to copy.
    popular = [list(range(100 * i, 100 * i + 16 * (i + 2) + i)) for i in range(4)]
    recent: dict[str, list[list[int]]] = {g: [] for g in GROUPS}
    running: list[str] = []
    copies_seen = 0
    for step in range(240):
        group = GROUPS[step % len(GROUPS)]
        victims = [g for g in GROUPS if g != group and recent[g]]
        choice = rng.random()
        if victims and choice < 0.55:
            # Replay another tenant's exact prompt (identical token ids), maybe extended.
            victim = rng.choice(victims)
            prompt = list(rng.choice(recent[victim]))
            if rng.random() < 0.5:
                prompt += [rng.randrange(50_000) for _ in range(rng.randrange(1, 20))]
        elif choice < 0.75:
            prompt = list(rng.choice(popular)) + [rng.randrange(50_000) for _ in range(rng.randrange(0, 12))]
        elif recent[group] and choice < 0.9:
            prompt = list(rng.choice(recent[group]))  # own reuse: must hit
        else:
            prompt = [rng.randrange(50_000) for _ in range(rng.randrange(1, 70))]
        branches = 2 if len(prompt) % BS and rng.random() < 0.3 else 1
        rid = tenants.admit(group, prompt, branches=branches)
        recent[group].append(prompt)
        if branches == 2:
            # Both branches write into the shared partial tail: one copy, attributed to this group only.
            ops = ledger.append_token(rid, 1) + ledger.append_token(f"{rid}/1", 2)
            audit(ledger)
            assert len(ops) == 1
            copies_seen += 1
            copied = [e for e in events.all() if e.kind == "copied" and e.block == ops[0].dst]
            assert copied[-1].trust_group == group and copied[-1].source_block == ops[0].src
        running.append(rid)
        if len(running) > 18:
            tenants.finish(running.pop(rng.randrange(len(running))))
        if step % 40 == 39:
            tenants.check_views()
    for rid in running:
        tenants.finish(rid)
    tenants.check_views()
    assert tenants.cross_only >= 50, "the workload should try many cross-tenant prefixes"
    assert copies_seen > 5
    assert sum(e["hit_blocks"] for e in tenants.expected.values()) > 0  # own reuse does hit
    assert ledger.usage().active == 0


def test_eviction_pressure_between_tenants_is_attributed_to_the_owner() -> None:
    events = EventLog()
    ledger = KVLedger(24, BS, events=events)
    tenants = Tenants(ledger, events)
    rng = random.Random(7)
    shared = list(range(5000, 5000 + 48))
    stored_by: dict[str, str] = {}
    for step in range(120):
        group = GROUPS[step % 4]  # four tenants fighting over a small pool
        prompt = shared + [rng.randrange(100) for _ in range(rng.randrange(0, 40))]
        if rng.random() < 0.3:
            prompt = shared[:32]
        rid = tenants.admit(group, prompt, max_new=0)
        tenants.finish(rid)
        # Tenants' models forget evicted prefixes: rebuild each group's cached prefixes from the index.
        for g in GROUPS[:4]:
            tenants.prefixes[g] = {
                p for p in tenants.prefixes[g]
                if chain_digests(ctx(g).root_digest(), token_bytes(list(p)), BS)[-1] in ledger.pool.index}
    for e in events.all():
        if e.kind == "stored":
            stored_by[e.digest] = e.trust_group
        elif e.kind in ("evicted", "removed", "cleared"):
            assert stored_by[e.digest] == e.trust_group
    assert any(e.kind == "evicted" for e in events.all())
    assert ledger.clear_cache() > 0
    audit(ledger)
    for e in events.all():
        if e.kind == "cleared":
            assert stored_by[e.digest] == e.trust_group
    tenants.check_views()


def test_near_collision_contexts_do_not_share() -> None:
    """Field values that concatenate to the same bytes, and groups that differ only by a separator."""
    ledger = KVLedger(64, BS)
    prompt = list(range(64))
    contexts = [
        CacheContext(trust_group="ab", model="c"),
        CacheContext(trust_group="a", model="bc"),
        CacheContext(trust_group="a\x00", model="bc"),
        CacheContext(trust_group="a", model="b", revision="c"),
        CacheContext(trust_group="a", model="bc", adapter=""),
        CacheContext(trust_group="a", model="bc", extra=(("k", "v"),)),
    ]
    for i, c in enumerate(contexts):
        d = ledger.admit(Request(f"r{i}", prompt, 0, c))
        audit(ledger)
        assert d.admitted and d.blocks_hit == 0, f"context {i} hit another context's blocks"
        ledger.mark_computed(f"r{i}", len(prompt))
        ledger.release(f"r{i}")
        audit(ledger)
    assert ledger.usage().retained == 4 * len(contexts)
    for i, c in enumerate(contexts):
        assert ledger.admit(Request(f"again{i}", prompt, 0, c)).blocks_hit == 4  # own reuse still hits
        audit(ledger)


def test_a_tenant_cannot_pin_another_tenants_prefix() -> None:
    ledger = KVLedger(16, BS)
    prompt = list(range(32))
    ledger.admit(Request("a", prompt, 0, ctx(GROUPS[0]))).raise_for_outcome()
    ledger.mark_computed("a", 32)
    ledger.release("a")
    audit(ledger)
    assert ledger.pin("steal", prompt, ctx(GROUPS[1])) == 0
    audit(ledger)
    assert ledger.usage().pinned == 0 and ledger.usage().retained == 2
    assert ledger.pin("own", prompt, ctx(GROUPS[0])) == 2
    audit(ledger)
