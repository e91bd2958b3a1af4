"""config.sync and hetero.replica_slowdown: defaults, and one clear error naming the field."""

import pytest

from helpers import tiny_gpt
from semijax.errors import ConfigError
from semijax.sync import settings as settings_lib
from semijax.train import config as config_lib


def config(**edits):
  c = tiny_gpt(tensor=2)
  c.mesh.data = 4
  c.sync.mode = "ssaw"
  for key, value in edits.items():
    node, _, field = key.rpartition(".")
    (c[node] if node else c)[field] = value
  return c


def test_defaults_are_sync_and_documented_values():
  run = config_lib.validate(tiny_gpt())
  assert run.sync == settings_lib.SyncSettings()
  assert run.sync.mode == "sync" and run.sync.replica_slowdown is None
  run = config_lib.validate(config(**{"hetero.replica_slowdown": (1, 1, 2, 4)}))
  assert run.sync.mode == "ssaw" and run.sync.replica_slowdown == (1.0, 1.0, 2.0, 4.0)


@pytest.mark.parametrize("edits, match", [
    ({"sync.mode": "semi"}, r"^config.sync.mode: 'semi' is not one of"),
    ({"sync.weighting": "linear"}, r"^config.sync.weighting: 'linear' is not one of"),
    ({"sync.outer": "adam"}, r"^config.sync.outer: 'adam' is not one of"),
    ({"sync.staleness_bound": -1}, r"^config.sync.staleness_bound: must be an integer >= 0"),
    ({"sync.local_steps": 0}, r"^config.sync.local_steps: must be an integer >= 1"),
    ({"sync.grace": -0.5}, r"^config.sync.grace: must be a number >= 0"),
    ({"sync.staleness_decay": 0.0}, r"^config.sync.staleness_decay: must be in \(0, 1\]"),
    ({"sync.lr_batch_power": 2.0}, r"^config.sync.lr_batch_power: must be in \[0, 1\]"),
    ({"sync.outer_momentum": 1.0}, r"^config.sync.outer_momentum: must be in \[0, 1\)"),
    ({"sync.outer_lr": 0.0}, r"^config.sync.outer_lr: must be a positive number"),
    ({"hetero.replica_slowdown": (1.0, 2.0)},
     r"^config.hetero.replica_slowdown: 2 factors \(1.0, 2.0\) for mesh.data = 4 replicas"),
    ({"hetero.replica_slowdown": (1.0, 2.0, 0.0, 1.0)},
     r"^config.hetero.replica_slowdown: every factor must be a positive finite number, got 0.0"),
    ({"mesh.data": 1, "mesh.tensor": 2, "batch_size": 8},
     r"^config.sync.mode: 'ssaw' combines data-parallel replicas, but mesh.data = 1"),
    ({"balance.policy": "migrate"}, r"^config.balance.policy: sync.mode 'ssaw' runs with"),
])
def test_bad_values_name_their_field(edits, match):
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(config(**edits))


def test_unknown_key():
  c = config()
  c.sync.bound = 3
  with pytest.raises(ConfigError, match=r"^config.sync.bound: unknown config key"):
    config_lib.validate(c)


def test_one_replica_per_process():
  c = config(**{"mesh.data": 4, "mesh.tensor": 1})
  with pytest.raises(ConfigError, match=r"^config.mesh.data: sync.mode 'ssaw' over 2 processes"):
    config_lib.validate(c, num_devices=4, process_count=2)
  c = config(**{"mesh.data": 2, "mesh.tensor": 1})
  with pytest.raises(ConfigError, match=r"^config.mesh.tensor: each process's 4 devices"):
    config_lib.validate(c, num_devices=8, process_count=2)
  c = config(**{"mesh.data": 2, "mesh.tensor": 1, "hetero.replica_slowdown": (1.0, 2.0)})
  with pytest.raises(ConfigError, match=r"^config.hetero.replica_slowdown: emulates replicas"):
    config_lib.validate(c, num_devices=2, process_count=2)
  assert config_lib.validate(config(**{"mesh.data": 2, "mesh.tensor": 1}), num_devices=2,
                             process_count=2).sync.mode == "ssaw"
