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

class Copies:
    """copy_pieces calls queued on up to ``workers`` threads of the batch's own; wait() ends them."""

    def __init__(self, workers: int = 0) -> None: ...
    def post(
        self,
        src: int,
        dst: int,
        n: int,
        run: int,
        outer: tuple[int, ...],
        src_strides: tuple[int, ...],
        dst_strides: tuple[int, ...],
        stream: bool,
        keep: object,
        /,
    ) -> None: ...
    def wait(self) -> None: ...
