"""Device profiles and the cost model that turns a profile into a rank ratio (not built yet)."""
