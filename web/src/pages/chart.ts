// Charts with uPlot (npm). `areaChart` stacks series by summing them before drawing.
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";

export interface SeriesDef { label: string; color: string; values: (number | null)[] }

export function lineChart(
  el: HTMLElement,
  title: string,
  xs: number[],
  series: SeriesDef[],
  opts: { stacked?: boolean; height?: number; yLabel?: string } = {},
): uPlot {
  let data: (number | null)[][] = series.map((s) => s.values);
  if (opts.stacked) {
    const acc = xs.map(() => 0);
    data = series.map((s) => s.values.map((v, i) => (acc[i] += v ?? 0)));
  }
  const width = Math.max(320, Math.min(el.clientWidth || 900, 1200));
  const plot = new uPlot(
    {
      title,
      width,
      height: opts.height ?? 220,
      scales: { x: { time: true } },
      axes: [{}, { label: opts.yLabel ?? "" }],
      series: [
        {},
        ...series.map((s) => ({
          label: s.label,
          stroke: s.color,
          fill: opts.stacked ? s.color + "66" : undefined,
          width: 1.5,
        })),
      ],
    },
    [xs, ...data] as uPlot.AlignedData,
    el,
  );
  el.setAttribute("role", "img");
  el.setAttribute("aria-label", `${title}: ${series.map((s) => s.label).join(", ")}`);
  return plot;
}
