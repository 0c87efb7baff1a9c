"""A stdout whose every line starts with a tag: the suites' ranks (suite.py, service_suite.py)
run several scripts or scenarios in one process, and the tests read each one's lines apart."""


class Tagged:
    """``stream`` with ``tag`` (``"<name>| "``) at the start of every line written to it."""

    def __init__(self, stream, tag: str):
        self.stream, self.tag, self.at_line_start = stream, tag, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self.at_line_start:
                out.append(self.tag)
            out.append(piece)
            self.at_line_start = piece.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)
