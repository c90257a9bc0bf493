"""decodescope dashboard: Dash pages over the store (see dashboard/app.py)."""
