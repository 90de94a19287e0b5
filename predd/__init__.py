"""predd: the pred daemon — sessions, KV store, scheduler, runner and model."""
