from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvoffloadd.config import ConfigError, DaemonConfig, load_config, parse_size


def test_sizes() -> None:
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("16k") == 16 << 10
    assert parse_size(4096) == 4096
    for bad in ("lots", "-1", "1 GiBs", 0, True):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_defaults_need_no_file() -> None:
    cfg = load_config(None, {})
    assert cfg.region_bytes == 1 << 30 and cfg.policy == "lru"
    assert cfg.socket_path.endswith("kvoffloadd.sock")
    assert cfg.extent_bytes == 16 << 20


def test_file_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text('region_size = "2GiB"\npolicy = "arc"\ninstance = "a"\n')
    cfg = load_config(str(f), {"policy": "lru", "socket": None})
    assert cfg.region_bytes == 2 << 30 and cfg.policy == "lru" and cfg.instance == "a"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("regoin_size = 5", "regoin_size"),
        ('policy = "fifo"', "fifo"),
        ("copy_threads = 0", "copy_threads"),
        ('region_size = "big"', "region_size"),
        ('instance = "a/b"', "instance"),
        ("copy_threads = 'two'", "copy_threads"),
        ("tier_threads = 65", "tier_threads: 65 is not in 0..64"),
        ("tier_threads = -1", "tier_threads"),
        ("region_size = [", "not valid TOML"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "k.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError, match=needle):
        load_config(str(f), {})


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config("/nonexistent/kvoffloadd.toml", {})


def test_tier_threads_default_to_the_cpus_the_daemon_may_run_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = load_config(None, {})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 6})  # a cpuset of three
    assert cfg.tier_thread_count == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(192)))
    assert cfg.tier_thread_count == 64
    assert load_config(None, {"tier_threads": 5}).tier_thread_count == 5


def test_region_name() -> None:
    assert DaemonConfig(instance="x").region_name == "/kvoffload-x"


MC_MASTER = 'master = "10.0.0.1:50051"\n'
MC_META = 'metadata_server = "http://10.0.0.1:8080/metadata"\n'
MC = '[[tiers]]\ntype = "mooncake"\n' + MC_MASTER


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('[[tiers]]\ntype = "tape"', "tiers.*tape"),
        ('[[tiers]]\ntype = "disk"\ncapacity = "1GiB"', "needs path and capacity"),
        ('[[tiers]]\ntype = "disk"\npath = "/x"', "needs path and capacity"),
        ('[[tiers]]\ntype = "redis"\nurl = "http://h"', "not a redis:// URL"),
        ('[[tiers]]\ntype = "redis"\nurl = "redis://h"\nthreads = 0', "threads"),
        ('[[tiers]]\ntype = "redis"\nurl = "redis://h"\nrefresh_s = -1', "refresh_s"),
        ('[[tiers]]\ntype = "redis"\nurl = "redis://h"\nchunk_size = "lots"', "chunk_size"),
        ('[[tiers]]\ntype = "redis"\nurl = "redis://h"\nprefix = "a b"', "prefix"),
        ('[[tiers]]\ntype = "redis"\nurl = "redis://h"\ncolor = 1', "color"),
        (
            '[[tiers]]\ntype = "redis"\nurl = "redis://a"\nname = "x"\n'
            '[[tiers]]\ntype = "redis"\nurl = "redis://b"\nname = "x"',
            "unique",
        ),
        ('[[tiers]]\ntype = "mooncake"\n' + MC_META, r"tiers\.mooncake\.master"),
        ('[[tiers]]\ntype = "mooncake"\nmaster = "h"\n' + MC_META, r"\.master: 'h'"),
        ('[[tiers]]\ntype = "mooncake"\n' + MC_MASTER, r"\.metadata_server"),
        (MC + 'metadata_server = "ftp://x"\n', r"\.metadata_server: 'ftp://x'"),
        (MC + MC_META + 'protocol = "udp"', r"\.protocol: 'udp'"),
        (MC + MC_META + 'protocol = "rdma"', r"\.device: protocol rdma"),
        (MC + MC_META + 'segment_size = "big"', r"\.segment_size"),
        (MC + MC_META + "local_buffer_size = 0", r"\.local_buffer_size"),
        (MC + MC_META + 'admin_url = "h:1"', r"\.admin_url"),
        (MC + MC_META + 'local_hostname = ""', r"\.local_hostname"),
        (MC + MC_META + "refresh_s = -1", r"\.refresh_s"),
        (MC + MC_META + "lease_ttl_s = -1", r"\.lease_ttl_s"),
        (MC + MC_META + 'segment_size = "-1MiB"', r"\.segment_size"),
        (MC + MC_META + "threads = 99", r"\.threads"),
        (MC + MC_META + "segment = 1", "segment"),  # a typo of segment_size: unknown
    ],
)
def test_bad_tiers_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "k.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError, match=needle):
        load_config(str(f), {})


def test_tiers_get_names_and_sizes(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text(
        '[[tiers]]\ntype = "disk"\npath = "/a"\ncapacity = "1GiB"\n'
        '[[tiers]]\ntype = "disk"\npath = "/b"\ncapacity = 4096\n'
        '[[tiers]]\ntype = "redis"\nurl = "redis://h:1/0"\n'
    )
    cfg = load_config(str(f), {})
    assert [t.name for t in cfg.tiers] == ["disk", "disk2", "redis"]
    assert [t.capacity_bytes for t in cfg.tiers] == [1 << 30, 4096, 0]
    assert cfg.tiers[2].chunk_bytes == 8 << 20


def test_a_mooncake_tier_takes_its_settings(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text(MC + MC_META + 'segment_size = "1GiB"\nprotocol = "rdma"\ndevice = "mlx5_0"\n')
    (t,) = load_config(str(f), {}).tiers
    assert (t.name, t.master, t.protocol, t.device) == (
        "mooncake",
        "10.0.0.1:50051",
        "rdma",
        "mlx5_0",
    )
    assert t.metadata_server == "http://10.0.0.1:8080/metadata" and t.segment_bytes == 1 << 30
    assert t.lease_ttl_s == 10.0  # mooncake_master's -default_kv_lease_ttl
    f.write_text(MC + MC_META + "segment_size = 0\nlease_ttl_s = 2.5\n")
    (t,) = load_config(str(f), {}).tiers
    assert (t.segment_bytes, t.lease_ttl_s) == (0, 2.5)  # lends none: uses others' segments


def test_the_documented_and_example_tier_configs_validate(tmp_path: Path) -> None:
    """The tiers of docs/tiers.md and the example's commented Mooncake tier,
    uncommented, are configs the daemon accepts."""
    root = Path(__file__).parents[2]
    documented = re.search(r"```toml\n(.*?)```", (root / "docs" / "tiers.md").read_text(), re.S)
    assert documented is not None
    f = tmp_path / "tiers.toml"
    f.write_text(documented.group(1))
    assert [t.type for t in load_config(str(f), {}).tiers] == ["disk", "redis", "mooncake"]
    example = (root / "systemd" / "kvoffloadd.toml.example").read_text()
    start = example.index('# type = "mooncake"') - len("# [[tiers]]\n")
    block = example[start : example.index("\n\n", start)]
    f.write_text("\n".join(line[2:] for line in block.splitlines()))
    (t,) = load_config(str(f), {}).tiers
    assert (t.type, t.master, t.protocol) == ("mooncake", "127.0.0.1:50051", "tcp")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("populate_threads = -1", "populate_threads"),
        ('populate_chunk_size = "1MiB"', "populate_chunk_size.*between 2MiB and 64GiB"),
        ('populate_chunk_size = "128GiB"', "populate_chunk_size"),
        ('numa = "interleave"', "numa: 'interleave' is not one of auto, off"),
        ('huge_pages = "4M"', "huge_pages: '4M' is not one of off, 2M, 1G, thp"),
        ('region_dir = "dev/hugepages"', "region_dir.*absolute"),
        ('memory_headroom = "lots"', "memory_headroom"),
        ('huge_pages = "1G"\nextent_size = "256MiB"', "extent_size.*1G huge page"),
    ],
)
def test_bad_region_placement_names_the_key(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "k.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError, match=needle):
        load_config(str(f), {})


def test_huge_pages_size_the_extents_and_the_chunks() -> None:
    cfg = load_config(None, {"huge_pages": "1G", "region_size": "64GiB"})
    assert cfg.page_bytes == 1 << 30 and cfg.extent_bytes == 1 << 30
    assert load_config(None, {"huge_pages": "2M"}).page_bytes == 2 << 20
    d = load_config(None, {})
    assert (d.populate_threads, d.populate_chunk_bytes, d.numa) == (0, 2 << 30, "auto")
    assert (d.huge_pages, d.region_dir, d.memory_headroom_bytes) == ("off", "", 1 << 30)
    assert d.check_memory_limits
    assert load_config(None, {"memory_headroom": 0}).memory_headroom_bytes == 0
