"""Who trains what: device levels from profiles, model costs, steady measured reports."""
