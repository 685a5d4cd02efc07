"""destroy_process_group really ends gloo's threads after tracinfunc ran (issue 25: the
torchrun test's rank aborted in teardown with "terminate called without an active exception").

Root cause: torch.func's first vmap imports torch._dynamo, and importing torch._dynamo while
a process group exists keeps references to that group. destroy_process_group then drops only
torch.distributed's own references, so the C++ ProcessGroupGloo and its threads
(``pt_gloo_runloop``, ``gloo_tcp_loop``) outlive it into interpreter finalization; a gloo
thread releasing a finished collective's tensors (which hold Python objects) then needs the
GIL of a finalizing interpreter and the process aborts. Whether it does depends on thread
scheduling (a loaded machine), but the threads outliving destroy_process_group does not:
that is what this test checks, deterministically.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.build.test_distributed import env, free_port

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                reason="lists threads through /proc (Linux)")

_SCRIPT = """
import os, time, torch
import torch.distributed as dist
import torch.nn.functional as F
import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp

def gloo_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return sorted(n for n in names if "gloo" in n)

dist.init_process_group("gloo")
# gloo's threads name themselves after they start: wait for the names (a loaded machine can
# take a while), so the precondition does not depend on scheduling.
for _ in range(600):
    if gloo_threads():
        break
    time.sleep(0.05)
assert gloo_threads(), "gloo runs threads while the group exists"
model = make_mlp(dtype=torch.float32).eval()
loss = tif.loss_from_module(model, F.cross_entropy)
tif.build_store(loss, make_checkpoints(model), make_data(8, dtype=torch.float32),
                projection=tif.Projection(dim=8))  # torch.func's vmap: imports torch._dynamo
gathered = [None]
dist.all_gather_object(gathered, (torch.ones(3), torch.arange(3)))
dist.barrier()
dist.destroy_process_group()
print("LEFT", gloo_threads())
"""


def test_no_gloo_thread_outlives_destroy_process_group(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_SCRIPT)
    environment = {**env(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=environment, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LEFT []" in done.stdout, (
        f"gloo threads alive after destroy_process_group: {done.stdout.strip()}")
