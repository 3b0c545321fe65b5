"""Runnable training recipes (model, optimizer, data, step). The flodl_run package never imports these."""
