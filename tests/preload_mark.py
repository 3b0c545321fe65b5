"""`python -m tests.preload_mark`: prints whether `mark()` ran in this process before it, as a
launch server's preload of `tests.preload_mark:mark` runs it before forking the launcher."""

marked = False


def mark() -> None:
    global marked
    marked = True


if __name__ == "__main__":
    import tests.preload_mark as preloaded  # the preloaded module, when the server had it

    print(preloaded.marked)
