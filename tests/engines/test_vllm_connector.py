"""kvtier's vLLM connector against vLLM's real classes (issue 15): engines in processes of their
own (`vllm_engine.py`: vLLM's v1 `Scheduler` on CPU with the connector loaded through
`kv_connector_module_path`, its worker side on paged CPU KV), one `kvtier serve` between them.

Engine 1 computes a prompt and saves it through the worker-side methods; engine 2's scheduler
gets the hit from kvtier (asynchronously: WAITING_FOR_REMOTE_KVS, then running; and
synchronously), its worker side loads it, and the KV in engine 2's paged blocks is bit-exact.
A load whose blocks left kvtier after the lookup becomes load errors and a recompute; tenants
(API keys, cache salts) never see each other's blocks; tensor-parallel ranks keep to sidecars
of their own shard.

Run with vLLM installed apart (the default suite does not collect this directory):

    bash tests/engines/install.sh vllm
    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/vllm python -m pytest tests/engines/test_vllm_*.py
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from engine_process import launch as run_engine
from engine_process import report as engine_report
from service_server import ADMIN_KEY, Server, running, write_config

from kvtier.client import Client

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

ENGINE = Path(__file__).with_name("vllm_engine.py")
ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdefgh"
NUM_BLOCKS = 64  # vllm_engine.py's; one is vLLM's null block
PROMPT = list(range(1000, 1040))  # 40 tokens: 2 whole vLLM blocks (32 tokens) are saved


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tenants = {"alice": {"api_keys": [ALICE]}, "bob": {"api_keys": [BOB]}}
    config = write_config(tmp_path_factory.mktemp("kvtier"), tenants=tenants)
    with running(config) as server:
        yield server


def launch(server: Server, **args: Any) -> subprocess.CompletedProcess[str]:
    return run_engine(
        ENGINE, {"url": server.url, "api_key": ALICE, "prompt": PROMPT, "seed": 5, **args}
    )


def engine(server: Server, **args: Any) -> dict[str, Any]:
    """Run one engine process to the end of its request; its report."""
    report = engine_report(launch(server, **args))
    assert report["finished"] == "FINISHED_LENGTH_CAPPED", report
    assert report["computed_prompt"], report  # every prompt token's KV right at the end
    return report


def saved(server: Server, prompt: list[int], key: str = ALICE) -> int:
    with Client(server.url, api_key=key) as client:
        return client.lookup(prompt).num_tokens


def test_engine_2_loads_what_engine_1_saved_bit_exact_async_and_sync(sidecar: Server) -> None:
    first = engine(sidecar, prompt=PROMPT)
    assert first["hit"] == 0 and first["stats"]["saved_tokens"] == 32
    assert saved(sidecar, PROMPT) == 32
    second = engine(sidecar, prompt=PROMPT)  # asynchronous load
    assert "WAITING_FOR_REMOTE_KVS" in second["statuses"], second["statuses"]
    assert second["loaded_tokens"] == 32 and second["bit_exact"] is True
    assert second["stats"]["loaded_tokens"] == 32 and second["load_errors"] == []
    third = engine(sidecar, prompt=PROMPT, load_async=False)  # synchronous, before the forward
    assert "WAITING_FOR_REMOTE_KVS" not in third["statuses"]
    assert third["loaded_tokens"] == 32 and third["bit_exact"] is True


def test_the_connectors_counts_reach_vllms_log_and_metrics(sidecar: Server) -> None:
    """Through vLLM's own path: the scheduler's stats aggregate the scheduler's and the
    worker's reports, and vLLM's connector logger and Prometheus counters read them."""
    prompt = list(range(1100, 1140))
    engine(sidecar, prompt=prompt, seed=6)  # saves it
    report = engine(sidecar, prompt=prompt, seed=6, load_async=False)
    assert report["prom"]["lookups"] == 1 and report["prom"]["hit_tokens"] == 32, report["prom"]
    assert report["prom"]["loaded_tokens"] == 32 and report["prom"]["errors"] == 0
    assert len(report["logged"]) == 1 and "loaded_tokens=32" in report["logged"][0], report


@pytest.mark.parametrize("save_async", [True, False])
def test_a_chats_next_turn_loads_the_output_its_last_turn_saved(
    sidecar: Server, save_async: bool
) -> None:
    """The output's whole blocks are saved when the request finishes, vLLM holding them until
    a worker reports them saved (one step when saves are inline) and then having every block
    back; the next turn, the history plus a new message, loads prompt and output bit-exact."""
    base = 5000 if save_async else 5500
    prompt = list(range(base, base + 40))  # 40 tokens, then 30 sampled: 69 computed, 64 whole
    history = prompt + [7] * 30
    first = engine(sidecar, prompt=prompt, seed=21, max_tokens=30, save_async=save_async)
    assert first["stats"]["saved_tokens"] == 64 and first["stats"]["decode_tokens"] == 32
    assert first["saved_when_freed"] == 64  # held until both saves were done
    assert first["held_steps"] >= 1 and first["free_blocks"] == NUM_BLOCKS - 1, first
    if not save_async:
        assert first["held_steps"] == 1
    assert saved(sidecar, history) == 64
    turn = engine(sidecar, prompt=history + list(range(6000, 6010)), seed=21, max_tokens=4,
                  save_async=save_async)  # fmt: skip
    assert turn["loaded_tokens"] == 64 and turn["bit_exact"] is True, turn
    assert turn["free_blocks"] == NUM_BLOCKS - 1


def test_a_weight_updates_cache_reset_forgets_kvtiers_copies_too(sidecar: Server) -> None:
    """vLLM's `reset_prefix_cache(reset_connector=True)`, an RL trainer's weight update: kvtier
    forgets the prompt, so the same prompt is computed with the new weights (seed + 1) and saved
    again, never loaded from the old ones; another engine then loads the new KV."""
    prompt = list(range(11000, 11040))
    report = engine(sidecar, prompt=prompt, seed=31, reset=True)  # saves the old weights' KV
    assert report["reset"] is True and report["held_after_reset"] == 0
    again = report["again"]
    assert again["loaded_tokens"] == 0 and again["computed_prompt"] is True, again
    assert again["saved_tokens"] == 64  # 32 of each weights' KV, the new in the old's place
    other = engine(sidecar, prompt=prompt, seed=32)
    assert other["loaded_tokens"] == 32 and other["bit_exact"] is True


@pytest.mark.parametrize("save_async", [True, False])
def test_a_reset_as_a_request_finishes_stores_none_of_its_old_kv(
    sidecar: Server, save_async: bool
) -> None:
    """The finished request's save (prompt and output) is planned when the reset comes: it only
    gives vLLM its blocks back, and the prompt's earlier save is forgotten."""
    prompt = list(range(11500 + 100 * save_async, 11540 + 100 * save_async))
    report = engine(sidecar, prompt=prompt, seed=33, max_tokens=30, save_async=save_async,
                    reset_when_finished=True)  # fmt: skip
    assert "reset" in report and report["free_blocks"] == NUM_BLOCKS - 1, report
    assert saved(sidecar, prompt + [7] * 30) == 0


@pytest.mark.parametrize("save_async", [True, False])
def test_without_save_decode_only_the_prompt_is_saved(sidecar: Server, save_async: bool) -> None:
    """And the request is held only while its prompt's save may be queued (async)."""
    other = list(range(7000, 7040)) if save_async else list(range(7100, 7140))
    off = engine(sidecar, prompt=other, seed=22, max_tokens=30, save_decode=False,
                 save_async=save_async)  # fmt: skip
    assert off["stats"]["saved_tokens"] == 32 and off["stats"]["decode_tokens"] == 0
    assert off["saved_when_freed"] == 32 and off["free_blocks"] == NUM_BLOCKS - 1
    assert (off["held_steps"] >= 1) if save_async else (off["held_steps"] == 0), off
    assert saved(sidecar, other + [7] * 30) == 32


def test_a_request_whose_output_fills_no_block_past_its_prompt_is_held_only_for_its_prompt(
    sidecar: Server,
) -> None:
    prompt = list(range(8000, 8040))  # 40 + 7 sampled: 46 computed, the prompt's 32 whole
    inline = engine(sidecar, prompt=prompt, seed=23, max_tokens=7, save_async=False)
    assert inline["stats"]["decode_tokens"] == 0 and inline["held_steps"] == 0
    assert inline["free_blocks"] == NUM_BLOCKS - 1
    queued = engine(sidecar, prompt=list(range(8100, 8140)), seed=23, max_tokens=7)
    assert queued["stats"]["decode_tokens"] == 0 and queued["held_steps"] >= 1
    assert queued["saved_when_freed"] == 32 and queued["free_blocks"] == NUM_BLOCKS - 1


def test_a_preemption_waits_for_the_queued_saves_before_the_forward(sidecar: Server) -> None:
    """`handle_preemptions` with the plan's `flush` returns once the queued save is done (its
    thread held 0.3 s), without it at once; queueing a save does not wait for it either."""
    prompt = list(range(9000, 9040))
    report = engine_report(launch(sidecar, prompt=prompt, seed=24, flush_check=True))
    assert report["first"] == 16 and report["before_flush"] == 16, report
    assert report["queue_s"] < 0.2 and report["no_flush_s"] < 0.2, report
    assert report["flush_s"] >= 0.25 and report["after_flush"] == 32, report
    assert saved(sidecar, prompt) == 32


def test_a_request_that_vllm_holds_the_head_of_loads_only_the_tail(sidecar: Server) -> None:
    """vLLM's own prefix cache holds the first block (a shorter prompt ran first in the same
    engine), kvtier the first two: the connector loads the second only (`load(start=)`), into
    the right vLLM block, bit-exact."""
    prompt = list(range(4000, 4040))
    engine(sidecar, prompt=prompt, seed=11)
    assert saved(sidecar, prompt) == 32
    report = engine(sidecar, prompt=prompt, seed=11, warm=prompt[:20])
    assert report["loaded_tokens"] == 32 and report["bit_exact"] is True, report
    assert report["warm_stats"]["loaded_tokens"] == 16  # the warm request's own hit
    assert report["stats"]["loaded_tokens"] - 16 == 16  # the tail past vLLM's block only
    assert report["load_errors"] == []


def test_a_save_sends_only_what_kvtier_lacked_and_all_of_it_once_that_left(
    sidecar: Server,
) -> None:
    """A prompt whose head kvtier held sends the KV of its tail only; if the head has left
    kvtier by the time of the save, the save sends the whole prompt and kvtier holds it all."""
    head = list(range(1200, 1240))  # 40 tokens: 32 saved
    first = engine(sidecar, prompt=head, seed=12)
    assert first["stats"]["sent_tokens"] == 32 == first["stats"]["saved_tokens"]
    longer = head + list(range(1300, 1340))  # 80 tokens: 32 loaded, 48 new
    tail = engine(sidecar, prompt=longer, seed=12, load_async=False)
    assert tail["loaded_tokens"] == 32 and tail["bit_exact"] is True
    assert tail["stats"]["sent_tokens"] == 48 == tail["stats"]["saved_tokens"], tail["stats"]
    assert saved(sidecar, longer) == 80
    # the head from vLLM's own cache (a warm request computed and saved it), not from a load
    # (whose lease keeps the blocks in kvtier a while), then cleared from kvtier before the save
    head = list(range(1250, 1290))
    other = head + list(range(1400, 1440))
    gone = engine(sidecar, prompt=other, seed=12, warm=head, clear_before_save=ADMIN_KEY)
    assert gone["loaded_tokens"] == 32 and gone["warm_stats"]["saved_tokens"] == 32
    sent = gone["stats"]["sent_tokens"] - gone["warm_stats"]["sent_tokens"]
    assert sent == 80 == gone["stats"]["saved_tokens"] - 32, gone["stats"]
    assert saved(sidecar, other) == 80
    again = engine(sidecar, prompt=other, seed=12)
    assert again["loaded_tokens"] == 64 and again["bit_exact"] is True


def test_blocks_vllm_holds_but_kvtier_lost_are_saved_again(sidecar: Server) -> None:
    """vLLM's own prefix cache covers the prompt, kvtier (cleared) holds none of it: the
    connector saves it from vLLM's blocks, so it outlives vLLM's eviction of them."""
    prompt = list(range(1500, 1540))
    report = engine(sidecar, prompt=prompt, seed=14, warm=prompt, clear_after_warm=ADMIN_KEY)
    assert report["hit"] == 0 and report["warm_stats"]["saved_tokens"] == 32
    assert report["stats"]["saved_tokens"] - report["warm_stats"]["saved_tokens"] == 32
    assert saved(sidecar, prompt) == 32
    again = engine(sidecar, prompt=prompt, seed=14)
    assert again["loaded_tokens"] == 32 and again["bit_exact"] is True


def test_a_load_whose_blocks_left_kvtier_is_a_load_error_and_a_recompute(
    sidecar: Server,
) -> None:
    prompt = list(range(2000, 2040))
    engine(sidecar, prompt=prompt, seed=9)
    assert saved(sidecar, prompt) == 32
    report = engine(sidecar, prompt=prompt, seed=9, clear_before_load=ADMIN_KEY)
    assert report["load_errors"] and report["stats"]["failed_loads"] == 1
    assert report["loaded_tokens"] < 32  # vLLM recomputed from the first block not loaded
    assert report["stats"]["saved_tokens"] == 32  # and the recomputed prompt is kvtier's again
    assert saved(sidecar, prompt) == 32


def test_tenants_by_key_and_by_cache_salt_never_share_blocks(sidecar: Server) -> None:
    prompt = list(range(3000, 3040))
    engine(sidecar, prompt=prompt, seed=3)  # alice's
    assert saved(sidecar, prompt) == 32 and saved(sidecar, prompt, BOB) == 0
    salted = engine(sidecar, prompt=prompt, seed=3, salt="a-salt-with-no-key")
    assert salted["hit"] == 0 and salted["stats"]["saved_tokens"] == 0  # kvtier untouched
    keyed = engine(sidecar, prompt=prompt, seed=3, salt="team-b", tenant_keys={"team-b": BOB})
    assert keyed["hit"] == 0  # bob's tenant holds nothing of alice's
    assert saved(sidecar, prompt, BOB) == 32  # bob's own copy, saved by the salted request
    bob = engine(sidecar, prompt=prompt, seed=3, api_key=BOB)
    assert bob["loaded_tokens"] == 32 and bob["bit_exact"] is True
    # a client writes kv_transfer_params itself: a name there counts only when the operator
    # trusts it (a gateway sets or strips it); otherwise the request does not use kvtier
    untrusted = engine(sidecar, prompt=prompt, seed=3, kv_transfer_params={"kvtier_tenant": "b"},
                       tenant_keys={"b": BOB})  # fmt: skip
    assert untrusted["hit"] == 0 and untrusted["stats"]["saved_tokens"] == 0
    assert untrusted["scheduler_stats"]["untrusted_names"] >= 1
    salted_too = engine(sidecar, prompt=prompt, seed=3, salt="team-b", tenant_keys={"b": BOB,
                        "team-b": BOB}, kv_transfer_params={"kvtier_tenant": "b"})  # fmt: skip
    assert salted_too["hit"] == 0  # the name does not fall back to the salt's tenant either
    named = engine(sidecar, prompt=prompt, seed=3, kv_transfer_params={"kvtier_tenant": "b"},
                   tenant_keys={"b": BOB}, trust_tenant_param=True, salt="b's")  # fmt: skip
    assert named["loaded_tokens"] == 32 and named["bit_exact"] is True  # bob's, by name
    unnamed = engine(sidecar, prompt=prompt, seed=3, kv_transfer_params={"kvtier_tenant": "x"},
                     trust_tenant_param=True)  # fmt: skip
    assert unnamed["hit"] == 0 and unnamed["stats"]["saved_tokens"] == 0  # no key: no kvtier


def test_a_request_with_a_lora_adapter_neither_reads_nor_writes_kvtier(sidecar: Server) -> None:
    """kvtier keys blocks by tokens; an adapter's KV for the same tokens differs (vLLM's own
    block hashes carry it), so the base model's blocks must not be loaded for it."""
    prompt = list(range(4000, 4040))
    engine(sidecar, prompt=prompt, seed=4)  # the base model's KV
    assert saved(sidecar, prompt) == 32
    adapted = engine(sidecar, prompt=prompt, seed=5, lora=["adapter", 1, "/adapters/a"])
    assert adapted["hit"] == 0 and adapted.get("loaded_tokens", 0) == 0
    assert adapted["scheduler_stats"]["other_inputs"] >= 1
    assert adapted["stats"]["saved_tokens"] == 0  # nor is its KV saved under the tokens


def test_a_sidecar_of_another_block_size_or_model_is_refused_at_start(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    for change, field in (({"block_tokens": 32}, "block_tokens"), ({"head_dim": 32}, "model")):
        path = write_config(tmp_path_factory.mktemp("other"), tenants={"a": {"api_keys": [ALICE]}})
        config = yaml.safe_load(path.read_text())
        if "head_dim" in change:
            config["model"] = {**config["model"], **change}
        else:
            config.update(change)
        path.write_text(yaml.safe_dump(config))
        with running(path) as other:
            done = launch(other)
        assert done.returncode != 0 and f"config field '{field}'" in done.stderr, done.stderr[-800:]


def test_a_hybrid_kv_cache_of_two_groups_is_refused_at_start(sidecar: Server) -> None:
    """Block ids are one group's; a second group's layers must not be written through them."""
    done = launch(sidecar, prompt=list(range(8)), seed=1, groups=2)
    refused = "config field 'kv_cache_groups'" in done.stderr
    assert done.returncode != 0 and refused, done.stderr[-800:]


def test_a_sliding_window_kv_cache_is_refused_at_start(sidecar: Server) -> None:
    """vLLM swaps the blocks that leave a window for its null block: saved, their zeros would
    be served as those tokens' KV."""
    done = launch(sidecar, prompt=list(range(8)), seed=1, sliding_window=32)
    refused = "config field 'kv_cache_spec'" in done.stderr and "SlidingWindowSpec" in done.stderr
    assert done.returncode != 0 and refused, done.stderr[-800:]


@pytest.mark.parametrize(
    ("extra", "named"),
    [({"kvtier.save_decodes": False}, "kvtier.save_decodes"),  # misspelt: not ignored
     ({"kvtier.load_async": "false"}, "kvtier.load_async")],  # a string is not false
)  # fmt: skip
def test_a_bad_connector_setting_is_refused_at_start(
    sidecar: Server, extra: dict[str, Any], named: str
) -> None:
    done = launch(sidecar, prompt=list(range(8)), seed=1, extra=extra)
    assert done.returncode != 0 and f"config field '{named}'" in done.stderr, done.stderr[-800:]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """Two sidecars, each holding one tensor-parallel rank's shard of the tiny model."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(running(shard_config(tmp_path_factory, rank))) for rank in (0, 1)
        ]


def shard_config(factory: pytest.TempPathFactory, rank: int) -> Path:
    path = write_config(factory.mktemp(f"rank{rank}"), tenants={"alice": {"api_keys": [ALICE]}})
    config = yaml.safe_load(path.read_text())
    config["model"] = {**config["model"], "tp_rank": rank, "tp_size": 2}
    path.write_text(yaml.safe_dump(config))
    return path


def test_tensor_parallel_ranks_keep_to_sidecars_of_their_own_shard(shards: list[Server]) -> None:
    urls = [shard.url for shard in shards]
    prompt = list(range(4000, 4040))
    first = engine(shards[0], prompt=prompt, tp_size=2, urls=urls)  # this process is rank 0
    assert first["stats"]["saved_tokens"] == 32
    assert saved(shards[0], prompt) == 32 and saved(shards[1], prompt) == 0
    again = engine(shards[0], prompt=prompt, tp_size=2, urls=urls)
    assert again["loaded_tokens"] == 32 and again["bit_exact"] is True
    crossed = launch(shards[0], prompt=prompt, tp_size=2, urls=urls[::-1])  # rank 0 -> shard 1
    assert crossed.returncode != 0 and "tp_rank" in crossed.stderr
    one_url = launch(shards[0], prompt=prompt, tp_size=2)
    assert one_url.returncode != 0 and "one sidecar URL per tensor-parallel rank" in one_url.stderr


def test_counts_are_reported_once_and_token_counts_by_one_rank() -> None:
    """Tensor-parallel ranks copy the same tokens: only rank 0 (and the scheduler) counts
    them, so vLLM's sum over workers is the engine's; failures are each rank's own."""
    from kvtier.integrations.vllm_stats import KvtierStats, gained_since

    stats, reported = {"loaded_tokens": 32, "errors": 1}, dict[str, int]()
    first = gained_since(stats, reported, 0)
    assert first is not None and first.data == {"loaded_tokens": 32, "errors": 1}
    assert gained_since(stats, reported, 0) is None  # nothing moved since
    stats["errors"] += 2
    again = gained_since(stats, reported, 0)
    assert again is not None and again.data == {"errors": 2}
    rank_1 = gained_since({"loaded_tokens": 32, "errors": 1}, {}, 1)
    assert rank_1 is not None and rank_1.data == {"errors": 1}
    one, two = KvtierStats(data={"errors": 1, "lookups": 0}), KvtierStats(data={"errors": 2})
    summed = one.aggregate(two)
    assert summed.data == {"errors": 3, "lookups": 0} and summed.reduce() == {"errors": 3}
    assert KvtierStats(data={"lookups": 0}).is_empty() and not summed.is_empty()


def test_a_kv_consumer_only_loads_and_a_kv_producer_only_saves(sidecar: Server) -> None:
    # vLLM's kv_role, as its is_kv_consumer / is_kv_producer read it: a decode instance
    # (consumer) reads what a prefill instance (producer) stored and writes nothing back
    prompt = list(range(13000, 13040))
    consumer = engine(sidecar, prompt=prompt, kv_role="kv_consumer")
    assert consumer["stats"]["sent_tokens"] == 0 and saved(sidecar, prompt) == 0
    assert consumer["scheduler_stats"]["lookups"] == 1  # it asked, and held nothing
    producer = engine(sidecar, prompt=prompt, kv_role="kv_producer")
    assert producer["stats"]["saved_tokens"] == 32 and saved(sidecar, prompt) == 32
    again = engine(sidecar, prompt=prompt, kv_role="kv_producer")  # held, but never asked
    assert again["hit"] == 0 and again["scheduler_stats"]["lookups"] == 0
    assert again["loaded_tokens"] == 0 and again["computed_prompt"]
    loaded = engine(sidecar, prompt=prompt, kv_role="kv_consumer", max_tokens=30)
    assert loaded["loaded_tokens"] == 32 and loaded["bit_exact"] is True
    assert loaded["stats"]["sent_tokens"] == 0  # not its output's blocks either
    assert saved(sidecar, prompt + [7] * 30) == 32


def test_a_hung_sidecar_holds_the_scheduler_one_short_lookup_not_one_per_request(
    sidecar: Server,
) -> None:
    # vLLM asks inside its scheduling loop: a sidecar that hangs (SIGSTOP) held every new
    # request for the client's 120 s; now one lookup waits 5 s at most (here the client's
    # first call, mapping the pools: 2.5 s), then none is asked for 10 s
    pid = sidecar.process.pid
    try:
        report = engine(sidecar, prompt=list(range(14000, 14040)), stop_pid=pid,
                        warm=list(range(14100, 14140)), kv_role="kv_consumer")  # fmt: skip
    finally:
        os.kill(pid, signal.SIGCONT)
    stats = report["scheduler_stats"]
    assert (stats["errors"], stats["skipped_lookups"], stats["lookups"]) == (1, 1, 0), stats
    assert 2.0 <= report["served_s"] < 40, report["served_s"]  # one bounded lookup
    assert saved(sidecar, list(range(14000, 14040))) == 0  # answering again; nothing saved
