def copy_pieces(
    src: int,
    dst: int,
    n: int,
    run: int,
    outer: tuple[int, ...],
    src_strides: tuple[int, ...],
    dst_strides: tuple[int, ...],
    stream: bool,
    /,
) -> None: ...
