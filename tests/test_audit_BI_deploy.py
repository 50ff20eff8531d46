"""Audit BI: the Kubernetes pod keeps kvtier's volume as kvtier made it across pods."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from kvtier.errors import ConfigError
from kvtier.service.auth import server_secret

POD = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "pod.yaml"


def _kubelet_fs_group_walk(root: Path) -> None:
    """What the kubelet does to a volume's tree on each mount under `fsGroup` with the default
    `fsGroupChangePolicy: Always` (`SetVolumeOwnership`): group read-write on every file, and
    on every directory group rwx and setgid too (the chown to the group is left out here)."""
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        extra = (stat.S_ISGID | 0o770) if stat.S_ISDIR(mode) else 0o660
        os.chmod(path, stat.S_IMODE(mode) | extra)


def test_a_volume_the_kubelet_walked_is_refused_so_the_pod_asks_it_not_to(tmp_path: Path) -> None:
    """The pod's comment offers a PersistentVolume to keep the cache across pods; its
    `fsGroup` made the kubelet widen every mode at the next pod's mount, and kvtier refuses a
    state directory others can write (exit 2 at every start: a crash loop). The pod now sets
    `fsGroupChangePolicy: OnRootMismatch`: the walk is skipped once the volume's root is the
    group's, as it is from the first pod on."""
    volume = tmp_path / "kvtier"  # /var/lib/kvtier, the mount
    volume.mkdir()
    first = server_secret(volume / "state")  # the first pod: made 0700, the secret 0600
    assert server_secret(volume / "state") == first
    _kubelet_fs_group_walk(volume)  # the next pod's mount, policy Always
    with pytest.raises(ConfigError) as refused:
        server_secret(volume / "state")
    assert refused.value.field == "service.state_dir"
    pod = next(d for d in yaml.safe_load_all(POD.read_text()) if d["kind"] == "Pod")["spec"]
    assert pod["securityContext"]["fsGroup"] == 10001
    assert pod["securityContext"].get("fsGroupChangePolicy") == "OnRootMismatch"
