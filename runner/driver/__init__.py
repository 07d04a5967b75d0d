"""The job's driver process: the recipe (`job`), its pre-flight checks (`checks`), the dispatcher
and its Ray pool, the record and resume, progress, the summary and report. Imports runner.serve
(the worker side) only to check the model and to start actors, never the other way round."""
