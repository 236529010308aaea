from django import template
from django.utils.safestring import SafeString

from chatapp.markdown import render_markdown

register = template.Library()


@register.filter
def markdown(text: str) -> SafeString:
    """A reply rendered as sanitised Markdown (chatapp.markdown)."""
    return render_markdown(text)
