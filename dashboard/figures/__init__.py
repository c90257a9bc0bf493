"""Pure figure builders: rows in, plotly Figure out; tested without a browser."""
