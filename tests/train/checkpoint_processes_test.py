"""Checksums over several processes: each process hashes only its share of a checkpoint's files,
when the record is written and when it is verified, and every process gets the same answer (a
2-process jax.distributed job on 127.0.0.1; only the coordination service is used)."""

import hashlib
import json
import os
import sys

import pytest

from helpers import ROOT
from semijax.runtime import launch

FILES = {"a": b"alpha", "b": b"bravo" * 3, "c/d": b"delta", "c/e": b"", "f": b"foxtrot"}

CHILD = r"""
import json, os, sys
sys.path.insert(0, {root!r})
from semijax.runtime import distributed
distributed.initialize()
import jax
from semijax.core import barrier
from semijax.train import checkpoint as ck
folder, hashed = {folder!r}, []
digest = ck._digest
ck._digest = lambda path: hashed.append(os.path.relpath(path, folder)) or digest(path)
out = {{}}
ck.record_checksums(folder)
out["record_hashed"], hashed[:] = sorted(hashed), []
out["intact"] = ck.check_files(folder)
out["verify_hashed"], hashed[:] = sorted(hashed), []
ck._INTACT.clear()                      # as a new run would: verify again
barrier.wait_for_all("verified")
if jax.process_index() == 0:            # same size, other bytes: only the digest tells
  with open(os.path.join(folder, "b"), "wb") as f:
    f.write(b"BRAVO" * 3)
barrier.wait_for_all("damaged")
out["damaged"] = ck.check_files(folder)
out["damaged_hashed"] = sorted(hashed)
print("RESULT", json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_each_process_hashes_its_share_and_all_agree(tmp_path):
  folder = tmp_path / "ckpt"
  for name, data in FILES.items():
    os.makedirs(os.path.dirname(folder / name), exist_ok=True)
    (folder / name).write_bytes(data)
  code = CHILD.format(root=ROOT, folder=str(folder))
  result = launch.launch([sys.executable, "-c", code], 2, timeout_s=120, log_dir=str(tmp_path))
  assert result.ok, result.failure_message()
  outs = []
  for path in result.log_paths:
    line = [s for s in open(path).read().splitlines() if s.startswith("RESULT ")][-1]
    outs.append(json.loads(line[len("RESULT "):]))
  record = json.loads((folder / "semijax_checksums.json").read_text())["files"]
  assert record == {n: [len(d), hashlib.sha256(d).hexdigest()] for n, d in FILES.items()}
  shares = [["a", "c/d", "f"], ["b", "c/e"]]            # every second sorted name
  for out, share in zip(outs, shares):
    assert out["record_hashed"] == share and out["verify_hashed"] == share
    assert out["intact"] is None
    # The damaged file is process 1's; both hear of it, process 0 without reading it, and
    # process 1 stops at it (its first file).
    assert out["damaged"] == "b does not match its checksum"
  assert [out["damaged_hashed"] for out in outs] == [shares[0], ["b"]]
