from flodl_run.rank.process import main

if __name__ == "__main__":
    raise SystemExit(main())
