"""OpenAI's Batch API: `/v1/files` and `/v1/batches`, run on idle capacity at a batch price.

    settings.py        BatchSettings (`[batch]`): bounds, price discount, pacing
    records.py         FileRecord, BatchRecord (statuses), LineResult; the OpenAI objects
    store.py           BatchStore: files' metadata, batches, line results, leases
    sqlite_store.py    embedded (no Redis)        redis_store.py   shared by every gateway
    file_directory.py  file contents on disk
    plan.py            an input file -> the lines to run, malformed ones apart, prefix order
    line_runner.py     one line through dispatch, rendered, with its usage record
    runner.py          the background task: validate -> run -> finalize, resumable
    service.py         the parts opened with the app (cleanup_ctx)
    handlers.py        the HTTP handlers (gateway/web/routes.py lists the URLs)
"""
