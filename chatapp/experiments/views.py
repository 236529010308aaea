"""The experiment pages: staff only (replays hold other people's measurements, not their chats)."""

from django.contrib.admin.views.decorators import staff_member_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from chatapp.experiments import charts
from chatapp.experiments.models import Experiment
from chatapp.experiments.report import TABLE_COLUMNS, cell, experiment_report


@require_GET
@staff_member_required
def experiment_list(request: HttpRequest) -> HttpResponse:
    experiments = Experiment.objects.all()[:200]
    return render(request, "experiments/list.html", {"experiments": experiments})


@require_GET
@staff_member_required
def experiment_detail(request: HttpRequest, experiment_id: int) -> HttpResponse:
    experiment = get_object_or_404(Experiment, pk=experiment_id)
    report = experiment_report(experiment)
    rows = [[cell(row.get(key), fmt) for key, _, fmt in TABLE_COLUMNS] for row in report["runs"]]
    context = {
        "experiment": experiment,
        "header": [title for _, title, _ in TABLE_COLUMNS],
        "rows": rows,
        "charts": [(name, charts.CHARTS[name][0]) for name in charts.available(experiment)],
    }
    return render(request, "experiments/detail.html", context)


@require_GET
@staff_member_required
def experiment_chart(request: HttpRequest, experiment_id: int, name: str) -> HttpResponse:
    experiment = get_object_or_404(Experiment, pk=experiment_id)
    if name not in charts.available(experiment):
        raise Http404("No such chart for this experiment.")
    return HttpResponse(charts.render(experiment, name), content_type="image/png")
