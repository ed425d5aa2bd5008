"""spmd.pipeline.checksum: combinable CRCs and the kind in use."""

import zlib

import numpy as np
import pytest

from spmd.errors import PipelineValueError
from spmd.pipeline import checksum


@pytest.mark.unit
@pytest.mark.parametrize("kind", [k for k in checksum.KINDS if k != "crc32c" or checksum.has_crc32c()])
def test_checksums_combine_into_the_checksum_of_the_concatenation(kind):
    crc = checksum.get(kind)
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 7, 4096, 65537, 3, 0, 1 << 20)]
    joined = 0
    for p in pieces:
        joined = crc.combine(joined, crc.of(p), p.size)
    assert joined == crc.of(np.concatenate(pieces))
    if kind == "crc32":
        assert crc.of(np.frombuffer(b"123456789", np.uint8)) == zlib.crc32(b"123456789") == 0xCBF43926
    else:
        assert crc.of(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283  # the CRC-32C check value
    # arrays of any dtype and layout: their bytes in C order
    a = rng.standard_normal((30, 7)).astype(np.float32)
    assert crc.of(a.T) == crc.of(np.ascontiguousarray(a.T))
    assert crc.of(a[10:], crc.of(a[:10])) == crc.of(a)


@pytest.mark.unit
def test_checksum_kind_is_the_fastest_installed_unless_named():
    assert checksum.kind({}) == ("crc32c" if checksum.has_crc32c() else "crc32")
    assert checksum.kind({"SPMD_CHECKSUM": "crc32"}) == "crc32"
    with pytest.raises(PipelineValueError, match="SPMD_CHECKSUM='md5': expected one of crc32, crc32c"):
        checksum.kind({"SPMD_CHECKSUM": "md5"})
