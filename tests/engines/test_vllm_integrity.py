"""kvtier's vLLM connector never stores KV that is not its tokens' (audit G), against vLLM's real
scheduler (`vllm_engine.py`) and a real `kvtier serve`:

- A load that fails (the blocks left kvtier between the lookup and the load) saves nothing of
  that step: not the blocks it never filled, nor what the step computed over them (a
  synchronous load's step); the prompt vLLM then recomputes is saved, and the next engine
  loads it bit-exact.
- A request that names its kvtier tenant in `kv_transfer_params` without a `cache_salt` of that
  tenant's own does not use kvtier: vLLM's prefix cache would hand it blocks another tenant's
  request loaded, which the connector would then save into its tenant.
- A request preempted by `reset_prefix_cache(reset_running_requests=True)` with its prompt's
  save queued makes the next step flush the saves, though vLLM resumed it in that step (and the
  connector's lookup replaced what it knew of the request).

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/vllm \\
        python -m pytest tests/engines/test_vllm_integrity.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from engine_process import report as engine_report
from service_server import ADMIN_KEY, Server
from test_vllm_connector import ALICE, BOB, engine, launch, saved
from test_vllm_connector import sidecar as sidecar  # the module's fixture

from kvtier.client import Client

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")
torch = pytest.importorskip("torch", reason="the engines' tests need torch")

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize(
    ("load_async", "save_async"), [(False, False), (False, True), (True, True)]
)
def test_a_failed_load_saves_nothing_of_its_step(
    sidecar: Server, load_async: bool, save_async: bool
) -> None:
    """Asynchronous loads too: the request runs only once its load is reported, failures with it."""
    base = 7000 + 10_000 * (2 * load_async + save_async)
    head = list(range(base, base + 40))  # 32 tokens saved
    engine(sidecar, prompt=head, seed=31)
    assert saved(sidecar, head) == 32
    longer = head + list(range(base + 100, base + 140))  # 80 tokens: kvtier holds 32
    failed = engine(sidecar, prompt=longer, seed=31, load_async=load_async,
                    clear_before_load=ADMIN_KEY, save_async=save_async)  # fmt: skip
    assert failed["load_errors"] and failed["stats"]["failed_loads"] == 1
    assert saved(sidecar, longer) == 80  # the prompt, recomputed, saved once more
    again = engine(sidecar, prompt=longer, seed=31)
    assert again["loaded_tokens"] == 64 and again["bit_exact"] is True, again


def test_a_named_tenant_without_its_own_cache_salt_does_not_use_kvtier(sidecar: Server) -> None:
    """vLLM's block hashes cover `cache_salt`, not `kv_transfer_params`: an unsalted request
    naming bob would reuse the blocks alice's request loaded from alice's kvtier."""
    prompt = list(range(8000, 8040))
    poison = torch.full((2, 2, 32, 2, 64), 3.0, dtype=torch.float16)  # alice's own bytes
    with Client(sidecar.url, api_key=ALICE) as client:
        client.store(prompt[:32], poison)
    named = {"kv_transfer_params": {"kvtier_tenant": "b"}, "tenant_keys": {"b": BOB},
             "trust_tenant_param": True}  # fmt: skip
    # the warm request (alice's) loads alice's bytes into vLLM's prefix cache; bob's hits them
    bob = engine_report(launch(sidecar, prompt=prompt, seed=41, warm=prompt, **named))
    assert bob["warm_stats"]["loaded_tokens"] == 32 and bob["loaded_tokens"] == 32
    assert saved(sidecar, prompt, BOB) == 0  # nothing of alice's in bob's tenant
    assert bob["scheduler_stats"]["unsalted_names"] >= 1
    # a salt that names another tenant is no salt of bob's own
    other = engine(sidecar, prompt=prompt, seed=41, salt="a-salt", **{
        **named, "tenant_keys": {"b": BOB, "a-salt": ALICE}})  # fmt: skip
    assert other["loaded_tokens"] == 0 and other["scheduler_stats"]["unsalted_names"] >= 1
    assert saved(sidecar, prompt, BOB) == 0
    # bob's own salt: vLLM keeps his blocks apart, and kvtier serves him
    salted = engine_report(launch(sidecar, prompt=prompt, seed=41, warm=prompt, salt="b-salt",
                                  **named))  # fmt: skip
    assert salted["loaded_tokens"] == 0  # not the warm request's blocks: another salt
    assert salted["scheduler_stats"]["unsalted_names"] == 0
    with Client(sidecar.url, api_key=BOB) as client:
        got = client.load(prompt)
    assert got.num_tokens == 32 and not torch.equal(got.kv[:, :, :32].cpu(), poison)


RESET_RUNNING = """
import json, sys, tempfile
from pathlib import Path
sys.path[:0] = [sys.argv[3], str(Path(sys.argv[3]).parent)]
import vllm_engine as ve
from vllm import SamplingParams
from vllm.v1.request import Request
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.utils.hashing import sha256
args = dict(url=sys.argv[1], api_key=sys.argv[2], save_async=True)
sched, worker, _ = ve.built(args)
init_none_hash(sha256)
p = SamplingParams(max_tokens=20); p.update_from_generation_config({}, 2)
req = Request(request_id="r", prompt_token_ids=list(range(9000, 9040)), sampling_params=p,
              pooling_params=None, block_hasher=get_request_block_hasher(16, sha256))
sched.add_request(req)
so = sched.schedule()
saves = [j.req_id for j in so.kv_connector_metadata.saves]
sched.update_from_output(so, ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0},
    sampled_token_ids=[[7]], kv_connector_output=KVConnectorOutput()))
assert sched.reset_prefix_cache(reset_running_requests=True)
so = sched.schedule()
print(json.dumps(dict(saves=saves, preempted=sorted(so.preempted_req_ids),
                      resumed=[n.req_id for n in so.scheduled_new_reqs]
                      + list(so.scheduled_cached_reqs.resumed_req_ids),
                      flush=so.kv_connector_metadata.flush)))
"""


def test_a_request_preempted_and_resumed_in_one_step_flushes_its_queued_save(
    sidecar: Server,
) -> None:
    script = textwrap.dedent(RESET_RUNNING)
    done = subprocess.run([sys.executable, "-c", script, sidecar.url, ALICE, str(HERE)],
                          capture_output=True, text=True, timeout=200, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["saves"] == ["r"] and seen["preempted"] == ["r"] and "r" in seen["resumed"]
    assert seen["flush"] is True, seen  # before the forward may write the freed blocks
