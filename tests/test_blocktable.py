"""The C parts of the index: ``routing._blocktable.BlockTable`` and ``routing._chain.chain_keys``.

Expected values come from plain Python models: a dict for the table, a
per-replica count for the walk, the bytes handed to a recording hasher for
the chaining loop.
"""

from __future__ import annotations

import random
import sys
from array import array

import pytest
import xxhash

from routing._blocktable import BlockTable
from routing._chain import chain_keys

M64 = 2**64 - 1


def fmix64(k: int) -> int:
    """MurmurHash3's 64-bit finaliser, written out: the table's slot placement (home = fmix64(key ^ seed))."""
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M64
    return k ^ (k >> 33)


def colliding_keys(seed: int, slots: int, first: int, homes: int, count: int, rng: random.Random) -> list[int]:
    """``count`` keys whose home slot, in a table of ``slots`` slots, is one of ``homes`` slots from ``first`` on."""
    out: list[int] = []
    while len(out) < count:
        k = rng.getrandbits(64)
        if (fmix64(k ^ seed) % slots - first) % slots < homes:
            out.append(k)
    return out


def check_same(table: BlockTable, model: dict[int, int], keys: list[int]) -> None:
    assert len(table) == len(model)
    for k in keys:
        assert table.get(k, None) == model.get(k)
        assert (k in table) == (k in model)


@pytest.mark.parametrize("seed", [0, 0x9E3779B97F4A7C15])
@pytest.mark.parametrize("first", [0, 60])  # runs from slot 60 wrap around the end of the array
def test_random_operations_with_probe_clusters_match_a_dict(seed: int, first: int) -> None:
    """Keys crowded into 4 home slots of the initial 64 make long probe runs; deletions must keep every run reachable."""
    rng = random.Random(seed + first)
    keys = colliding_keys(seed, 64, first, 4, 24, rng) + [0, M64]  # 26 keys: no resize below 33
    table, model = BlockTable(seed=seed), {}
    for _ in range(20_000):
        k = rng.choice(keys)
        op = rng.random()
        if op < 0.45:
            model[k] = table_value = rng.getrandbits(rng.choice((4, 80)))
            table[k] = table_value
        elif op < 0.65:
            assert table.pop(k, None) == model.pop(k, None)
        elif op < 0.8:
            if k in model:
                del table[k], model[k]
            else:
                with pytest.raises(KeyError):
                    del table[k]
        else:
            if k in model:
                assert table[k] == model[k]
            else:
                with pytest.raises(KeyError):
                    table[k]
        assert len(table) == len(model)
    check_same(table, model, keys)


def test_growth_keeps_every_entry() -> None:
    rng = random.Random(3)
    table, model = BlockTable(seed=rng.getrandbits(64)), {}
    keys = [rng.getrandbits(64) for _ in range(50_000)]
    for i, k in enumerate(keys):
        table[k] = model[k] = i % 7 + 1
    for k in keys[::3]:
        del table[k], model[k]
    check_same(table, model, keys)
    assert table.memory_bytes() >= 2 * 16 * len(table)  # 16-byte slots, load factor at most 1/2
    table.clear()
    assert len(table) == 0 and table.get(keys[1]) is None
    table[keys[1]] = 5
    assert table[keys[1]] == 5


def test_bad_keys_and_values_are_refused_without_damage() -> None:
    table = BlockTable(seed=1)
    table[7] = 3
    for bad in (-1, 2**64, 2**70):
        with pytest.raises(OverflowError):
            table[bad] = 1
        with pytest.raises(OverflowError):
            table.get(bad)
    for bad in ("7", 7.0, None, b"\x07"):
        with pytest.raises(TypeError):
            table.get(bad)  # type: ignore[arg-type]
    for value in ("x", 1.5, None, [1]):
        with pytest.raises(TypeError):
            table[8] = value  # type: ignore[assignment]
    with pytest.raises(TypeError):
        table.get()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        table.walk([7])  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        table.walk(7, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        table.walk([7], "1")  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        table.walk([7, -1], 1)
    assert len(table) == 1 and table[7] == 3 and 8 not in table


def test_references_to_masks_are_counted() -> None:
    mask = 2**100 + 12345  # a fresh int object only this test holds
    base = sys.getrefcount(mask)
    table = BlockTable()
    table[1] = mask
    table[2] = mask
    assert sys.getrefcount(mask) == base + 2
    table[2] = 5  # replaced
    assert sys.getrefcount(mask) == base + 1
    got = table.pop(1, None)
    assert got is mask and sys.getrefcount(mask) == base + 1
    del got
    table[1] = mask
    del table[1]
    assert sys.getrefcount(mask) == base
    table[3] = mask
    table.clear()
    assert sys.getrefcount(mask) == base
    table[4] = mask
    del table
    assert sys.getrefcount(mask) == base


def reference_walk(masks: dict[int, int], keys: list[int], alive: int) -> dict[int, int]:
    """bit -> consecutive leading keys whose mask has that bit."""
    held = {}
    bit = 1
    while bit <= alive:
        if alive & bit:
            n = 0
            while n < len(keys) and masks.get(keys[n], 0) & bit:
                n += 1
            held[bit] = n
        bit <<= 1
    return held


@pytest.mark.parametrize("trial", range(40))
def test_walk_matches_the_per_replica_count(trial: int) -> None:
    rng = random.Random(trial)
    bits = rng.choice((3, 8, 70))  # 70 replicas: masks beyond 64 bits
    keys = [rng.getrandbits(64) for _ in range(rng.randrange(0, 60))]
    masks: dict[int, int] = {}
    table = BlockTable(seed=trial)
    # Runs of equal masks that lose and gain replicas along the prompt, with gaps.
    full = (1 << bits) - 1
    mask = full
    for k in keys:
        if rng.random() < 0.15:
            mask = full & rng.getrandbits(bits) | (mask & rng.getrandbits(bits))
        if rng.random() < 0.03:
            continue  # nobody holds this block
        if mask:
            masks[k] = mask
            table[k] = mask
    alive = full & rng.getrandbits(bits) if trial % 4 else full
    drops, end = table.walk(keys, alive)
    want = reference_walk(masks, keys, alive)
    got: dict[int, int] = {}
    for i, dropped in drops:
        assert dropped and dropped & alive == dropped
        bit = 1
        while bit <= dropped:
            if dropped & bit:
                assert bit not in got
                got[bit] = i
            bit <<= 1
    assert got == want
    assert end == max(want.values(), default=0)
    assert [i for i, _ in drops] == sorted(i for i, _ in drops)


def test_walk_accepts_any_sequence_of_keys() -> None:
    table = BlockTable()
    for k in (10, 11, 12):
        table[k] = 0b11
    table[13] = 0b01
    want = ([(3, 0b10), (4, 0b01)], 4)
    assert table.walk([10, 11, 12, 13], 0b11) == want
    assert table.walk((10, 11, 12, 13), 0b11) == want
    assert table.walk(array("Q", [10, 11, 12, 13]), 0b11) == want
    assert table.walk([], 0b11) == ([(0, 0b11)], 0)
    assert table.walk([10], 0) == ([], 0)


def test_chain_loop_hashes_each_block_with_its_tail_from_the_previous_key() -> None:
    tokens = array("I", range(100, 100 + 12))
    seen: list[tuple[bytes, int]] = []

    def hasher(data, seed):
        seen.append((bytes(data), seed))
        return (seed * 31 + len(seen)) & M64

    keys = chain_keys(hasher, tokens, 4, 99, b"\xffT")
    raw = tokens.tobytes()
    assert seen == [(raw[0:16] + b"\xffT", 99), (raw[16:32] + b"\xffT", keys[0]), (raw[32:48] + b"\xffT", keys[1])]
    assert keys[0] == (99 * 31 + 1) & M64
    real = xxhash.xxh3_64_intdigest
    assert chain_keys(real, tokens, 4, 0, b"") == [
        k := real(raw[0:16], 0), k := real(raw[16:32], k), real(raw[32:48], k)
    ]
    assert chain_keys(real, array("I"), 4, 0, b"") == []


def test_chain_loop_errors() -> None:
    real = xxhash.xxh3_64_intdigest
    with pytest.raises(ValueError):
        chain_keys(real, array("I", range(7)), 4, 0, b"")  # not whole blocks
    with pytest.raises(ValueError):
        chain_keys(real, array("I", range(8)), 0, 0, b"")
    with pytest.raises(TypeError):
        chain_keys(real, array("I", range(8)), 4, 0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        chain_keys(real, [1, 2, 3, 4], 4, 0, b"")  # not a buffer

    def failing(data, seed):
        raise RuntimeError("hasher failed")

    with pytest.raises(RuntimeError, match="hasher failed"):
        chain_keys(failing, array("I", range(8)), 4, 0, b"")


def test_key_events_fold_in_like_the_documented_loop() -> None:
    """``add`` / ``remove`` / ``clear_bit`` against their definitions run on dicts, predictions included."""
    from routing._blocktable import Predictions
    from routing.key_events import keys_to_bytes

    rng = random.Random(11)
    table, preds = BlockTable(seed=5), Predictions(seed=9)
    masks: dict[int, int] = {}
    model: dict[int, int] = {}  # key -> mask (real or predicted)
    predicted: set[tuple[int, int]] = set()  # (key, slot)
    keys = [rng.getrandbits(64) for _ in range(40)]
    for step in range(600):
        slot = rng.randrange(3)
        bit = 1 << slot
        batch = [rng.choice(keys) for _ in range(rng.randrange(0, 6))]
        wire = keys_to_bytes(batch) if step % 2 else batch  # both key forms
        op = rng.random()
        if op < 0.15:  # a prediction for the blind window
            table.predict(preds, batch, bit, slot, 1e9, masks)
            for k in batch:
                if not model.get(k, 0) & bit:
                    model[k] = model.get(k, 0) | bit
                    predicted.add((k, slot))
        elif op < 0.6:
            want = [0, 0, 0]
            for k in batch:
                if not model.get(k, 0) & bit:
                    model[k] = model.get(k, 0) | bit
                    want[0] += 1
                elif (k, slot) in predicted:
                    predicted.discard((k, slot))
                    want[1] += 1
                else:
                    want[2] += 1
            assert table.add(preds, wire, bit, slot, masks) == tuple(want)
        elif op < 0.95:
            want = [0, 0]
            for k in batch:
                if model.get(k, 0) & bit and (k, slot) not in predicted:
                    model[k] &= ~bit
                    if not model[k]:
                        del model[k]
                    want[0] += 1
                else:
                    want[1] += 1
            assert table.remove(preds, wire, bit, slot, masks) == tuple(want)
        else:
            preds.clear_replica(slot)
            predicted = {(k, s) for k, s in predicted if s != slot}
            had = sum(1 for m in model.values() if m & bit)
            assert table.clear_bit(bit, masks) == had
            model = {k: m & ~bit for k, m in model.items() if m & ~bit}
        check_same(table, model, keys)
        assert len(preds) == len(predicted)
    for k in keys:  # stored masks are the interned objects
        if k in table:
            assert table[k] is masks[table[k]]


def test_key_events_refuse_bad_arguments_before_any_change() -> None:
    from routing._blocktable import Predictions

    table, preds = BlockTable(), Predictions()
    for args in (([5], 1, 0, {}), (preds, [5], "1", 0, {}), (preds, [5], 1, 0, None), (preds, 5, 1, 0, {}),
                 (None, [5], 1, 0, {})):
        with pytest.raises(TypeError):
            table.add(*args)
        with pytest.raises(TypeError):
            table.remove(*args)
    with pytest.raises(OverflowError):
        table.add(preds, [5, -5], 1, 0, {})
    with pytest.raises(ValueError):
        table.add(preds, b"\x00" * 12, 1, 0, {})  # not whole uint64s
    assert len(table) == 0  # nothing before the bad key went in
    with pytest.raises(TypeError):
        table.clear_bit("1", {})


def test_blind_window_predict_and_expire_against_a_model() -> None:
    """``predict`` / ``expire`` / ``Predictions`` against dicts: (key, replica) -> until, key -> mask."""
    import struct

    from routing._blocktable import Predictions

    rng = random.Random(21)
    holders, preds, masks = BlockTable(seed=2), Predictions(seed=3), {}
    model_masks: dict[int, int] = {}
    model_until: dict[tuple[int, int], float] = {}
    keys = [rng.getrandbits(64) for _ in range(30)]
    for k in keys[:8]:  # really held by replica 0
        holders[k] = model_masks[k] = 1
    records: list[tuple[int, bytes]] = []
    now = 0.0
    for step in range(400):
        now += 0.25
        replica = rng.randrange(3)
        bit = 1 << replica
        if rng.random() < 0.6:
            batch = rng.sample(keys, rng.randrange(1, 8))
            until = now + rng.choice((0.5, 1.0, 2.0))
            new, tracked = holders.predict(preds, batch, bit, replica, until, masks)
            want_new, want_tracked = 0, []
            for k in batch:
                if model_masks.get(k, 0) & bit:
                    if (k, replica) not in model_until:
                        continue  # really held
                    model_until[k, replica] = until
                else:
                    model_masks[k] = model_masks.get(k, 0) | bit
                    model_until[k, replica] = until
                    want_new += 1
                want_tracked.append(k)
            assert new == want_new
            assert list(struct.unpack(f"<{len(tracked) // 8}Q", tracked)) == want_tracked
            records.append((replica, tracked))
        elif records:
            replica, tracked = records.pop(rng.randrange(len(records)))
            bit = 1 << replica
            got = holders.expire(preds, tracked, bit, replica, now, masks)
            want = 0
            for k in struct.unpack(f"<{len(tracked) // 8}Q", tracked):
                until = model_until.get((k, replica))
                if until is None or until > now:
                    continue
                del model_until[k, replica]
                model_masks[k] &= ~bit
                if not model_masks[k]:
                    del model_masks[k]
                want += 1
            assert got == want
        assert len(preds) == len(model_until)
        for k in keys:
            assert holders.get(k) == model_masks.get(k)
            for r in range(3):
                assert preds.until(k, r) == model_until.get((k, r))
    # A confirmation (discard) and a cleared replica.
    k, r = next(iter(model_until))
    assert preds.discard(k, r) and not preds.discard(k, r)
    del model_until[k, r]
    gone = sorted(preds.clear_replica(1))
    assert gone == sorted(k for k, r in model_until if r == 1)
    assert len(preds) == sum(1 for _, r in model_until if r != 1)
    assert preds.memory_bytes() >= 24 * len(preds)


def test_blind_window_refuses_bad_arguments() -> None:
    from routing._blocktable import Predictions

    holders, preds = BlockTable(), Predictions()
    with pytest.raises(TypeError):
        holders.predict(BlockTable(), [1], 1, 0, 1.0, {})  # not a Predictions
    with pytest.raises(TypeError):
        holders.predict(preds, [1], 1, 0, "soon", {})
    with pytest.raises(OverflowError):
        holders.predict(preds, [1], 1, -1, 1.0, {})
    with pytest.raises(ValueError):
        holders.expire(preds, b"\x00" * 7, 1, 0, 1.0, {})  # not whole uint64 keys
    with pytest.raises(TypeError):
        preds.until(1)  # type: ignore[call-arg]
    assert len(holders) == 0 and len(preds) == 0


def test_reentrant_or_odd_callers_cannot_corrupt_the_table() -> None:
    """Found in review: int subclasses, non-int interned masks, reused key objects, a hasher that resizes its buffer."""

    class Alive(int):
        def __rand__(self, other):  # would run Python code in the walk
            raise AssertionError("called")

    table = BlockTable()
    table[1] = 1
    with pytest.raises(TypeError):
        table.walk([1], Alive(1))
    from routing._blocktable import Predictions

    with pytest.raises(TypeError):
        table.add(Predictions(), [5], 1, 0, {1: 1.0})  # an interned "mask" that is not an int
    assert 5 not in table

    def resizing(data, seed):
        data.extend(b"xx")  # the scratch buffer grows under the loop
        return xxhash.xxh3_64_intdigest(bytes(data[:-2]), seed)

    tokens = array("I", range(12))
    assert chain_keys(resizing, tokens, 4, 0, b"") == chain_keys(xxhash.xxh3_64_intdigest, tokens, 4, 0, b"")


def test_add_holds_its_own_reference_to_the_bit_while_masks_change_under_it() -> None:
    """Found in review: a key's __eq__ run by add's dict call could clear ``masks`` and
    free the interned bit add was still inserting (use after free)."""
    from routing._blocktable import Predictions

    big, other = 1 << 100, 1 << 101

    class ClearsMasks:
        def __hash__(self):
            return hash(other | big)  # collides with the mask or_bit interns for key 1

        def __eq__(self, _):
            masks.clear()
            return False

    table = BlockTable()
    table[1] = other  # key 1 held by another replica: add takes the or_bit path there
    interned = int(str(big))
    masks = {interned: interned, ClearsMasks(): 0}
    del interned
    assert table.add(Predictions(), [1, 2, 3, 4], int(str(big)), 0, masks) == (4, 0, 0)
    _ = [int(str(1 << (90 + i))) for i in range(1000)]  # reuse freed memory, if any was freed
    assert [table[k] for k in (2, 3, 4)] == [big] * 3 and table[1] == other | big
