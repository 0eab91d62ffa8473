OP_WORDS: int
OP_PACK: int
OP_UNPACK: int
OP_START: int
OP_WAIT: int
GROUP_WORDS: int
COPY_WORDS: int
COLUMNS: int
FAIL_TIMEOUT: int
FAIL_TRANSPORT: int
FAIL_SIZE: int
FAIL_SIGNAL: int

def run(
    ops: int,
    nops: int,
    groups: int,
    ngroups: int,
    copies: int,
    ncopies: int,
    addresses: int,
    sizes: int,
    nbuf: int,
    expect: int,
    requests: int,
    req_size: int,
    statuses: int,
    status_size: int,
    indices: int,
    byte_type: int,
    undefined: int,
    start: int,
    test: int,
    count: int,
    timeout_ns: int,
    times: int,
    fail: int,
    /,
) -> int: ...
def validate(
    ops: int,
    nops: int,
    groups: int,
    ngroups: int,
    copies: int,
    ncopies: int,
    addresses: int,
    sizes: int,
    nbuf: int,
    /,
) -> int: ...
def addresses(buffers: object, addresses: int, sizes: int, readonly: int, /) -> int: ...
