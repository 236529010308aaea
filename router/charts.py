"""A matplotlib figure as a PNG data URL, for the admin's charts (router and chatapp pages)."""

import base64
import io

from matplotlib.figure import Figure


def png_data_url(figure: Figure) -> str:
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
