from flodl_run.launch import launchserver

# First, while this is one bare thread: the server the bench's runs fork from on a CPU rig
# (it imports only when the plan is known to be one; flodl_run/launch/launchserver.py).
launchserver.prefork()

from flodl_run.bench.run import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
