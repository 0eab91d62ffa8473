MAX_DIMS: int
BUF: int
OFF: int
STAGE: int
NBYTES: int
NDIM: int
SHAPE0: int
STRIDE0: int
CAST: int
COLUMNS: int
STREAM_MIN: int

def copy_rows(
    table: int, rows: int, addresses: int, sizes: int, buffers: int, staging: int, staging_size: int, unpack: bool, /
) -> int: ...
