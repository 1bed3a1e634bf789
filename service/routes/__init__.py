"""HTTP routes: thin functions from a request to the module that does the work."""
