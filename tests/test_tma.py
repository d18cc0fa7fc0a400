"""The tensor maps of the piped sm90 forward, as the host describes them (no GPU)."""
from cuattn._tma import map_shape


def test_map_of_a_contiguous_tensor():
    """q of shape (2, 3, 100, 128) in float16: rank 5 innermost first, byte strides."""
    shape = map_shape(128, 100, (1, 2, 3), (0, 3 * 100 * 128, 100 * 128, 128, 1), 2, 64)
    assert shape.extents == (128, 100, 3, 2, 1)
    assert shape.strides == (256, 100 * 256, 300 * 256, 16)
    assert shape.box == (64, 64, 1, 1, 1)


def test_map_of_a_broadcast_axis_and_a_single_row():
    """A batch axis of stride 0 and a lone query row (whose stride is never walked, and
    which a caller's layout may give any value) both take extent 1 and a valid stride."""
    shape = map_shape(128, 1, (1, 2, 3), (0, 3 * 128, 0, 0, 1), 2, 64)
    assert shape.extents == (128, 1, 1, 2, 1)
    assert shape.strides == (16, 16, 3 * 256, 16)
    odd = map_shape(64, 1, (1, 1, 4), (0, 0, 72, 7, 1), 2, 64)
    assert odd is not None and odd.strides[0] == 16


def test_map_refuses_what_the_copy_engine_cannot_read():
    """A column stride other than 1, or a row stride that is not a multiple of 16 bytes."""
    assert map_shape(128, 10, (1, 1, 2), (0, 0, 2560, 256, 2), 2, 64) is None
    assert map_shape(100, 10, (1, 1, 2), (0, 0, 1000, 100, 1), 2, 64) is None
    assert map_shape(104, 10, (1, 1, 2), (0, 0, 1040, 104, 1), 2, 64) is not None
