"""jaxkv.runner.huge_pages: the weights' memory moved onto 2 MiB pages, their values unchanged."""

import platform

import jax
import numpy as np
import pytest

from jaxkv.runner import huge_pages


def test_page_range_covers_the_bytes_with_whole_pages():
    H = huge_pages.HUGE_PAGE
    assert huge_pages.page_range(H, H) == (H, 2 * H)
    assert huge_pages.page_range(H + 8, H) == (H, 3 * H)
    assert huge_pages.page_range(3 * H - 1, 2) == (2 * H, 4 * H)


def anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def thp_collapse_available() -> bool:
    """Transparent huge pages on (``always`` or ``madvise``) and MADV_COLLAPSE (Linux 6.1)."""
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    release = tuple(int(x) for x in platform.release().split(".")[:2] if x.isdigit())
    return "[never]" not in mode and release >= (6, 1)


@pytest.mark.skipif(not open("/proc/version").read().startswith("Linux"), reason="Linux only")
def test_collapse_keeps_values_and_what_it_reports_is_on_huge_pages(monkeypatch):
    rng = np.random.default_rng(0)
    host = rng.standard_normal((3, 1 << 20), dtype=np.float32)     # 12 MiB
    params = {"w": jax.device_put(host)}
    address = params["w"].unsafe_buffer_pointer()
    monkeypatch.setattr(huge_pages, "ENABLED", False)
    assert huge_pages.collapse(params) == 0
    monkeypatch.setattr(huge_pages, "ENABLED", True)
    done = huge_pages.collapse(params)
    np.testing.assert_array_equal(np.asarray(params["w"]), host)
    start, end = huge_pages.page_range(address, host.nbytes)
    H = huge_pages.HUGE_PAGE
    inner = (address + host.nbytes) // H * H - -(-address // H) * H   # whole pages of its own
    if thp_collapse_available():
        assert done > 0
    if done:
        # the kernel says it collapsed them: at least the array's own whole pages, at most the
        # pages that hold it, and its mapping shows them
        assert inner <= done <= end - start
        assert anon_huge_bytes(address + host.nbytes // 2) >= done


def test_collapse_in_background_moves_the_pages_and_logs(caplog, monkeypatch):
    host = np.arange(3 << 20, dtype=np.float32).reshape(3, -1)
    x = jax.device_put(host)
    monkeypatch.setattr(huge_pages, "ENABLED", False)
    assert huge_pages.collapse_in_background({"w": x}) is None
    monkeypatch.setattr(huge_pages, "ENABLED", True)
    with caplog.at_level("INFO", logger="jaxkv"):
        huge_pages.collapse_in_background({"w": x}).join(timeout=60)
    np.testing.assert_array_equal(np.asarray(x), host)
    if thp_collapse_available():
        assert any("weights on 2 MiB pages" in r.getMessage() for r in caplog.records)
        assert anon_huge_bytes(x.unsafe_buffer_pointer() + x.nbytes // 2) >= 2 << 20
