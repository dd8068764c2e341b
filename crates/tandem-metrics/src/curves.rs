//! Training curves as a PNG: a title (the run folder and model), loss per epoch (train and
//! val) on the left, validation accuracy per epoch on the right.
//!
//! Everything is drawn by hand on an RGB canvas: axes with "nice" ticks, grid lines,
//! 2 px lines (Bresenham with a 2x2 brush), a dot per epoch, and text from an embedded
//! 5x7 bitmap font, so no font file or plotting crate is needed. Non-finite values are
//! skipped; empty input gives empty axes. A loss far above all the others (one huge first
//! validation loss) is left off the loss axis, so the other points keep their detail: it is
//! drawn on the axis's top edge with its value written beside it.

use std::io::Cursor;

use image::{ImageFormat, Rgb, RgbImage};

use crate::MetricsError;

/// One epoch's figures, as the plot needs them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CurvePoint {
    /// The epoch number (the x coordinate).
    pub epoch: u64,
    /// Mean training loss of the epoch.
    pub train_loss: f64,
    /// Validation loss after the epoch.
    pub val_loss: f64,
    /// Validation accuracy after the epoch, as a fraction in 0..=1.
    pub val_accuracy: f64,
}

/// Draws `title` above training/validation loss (left panel) and validation accuracy
/// (right panel) per epoch as a PNG and returns its bytes. Non-finite values are left out
/// of the curves.
pub fn render_training_curves(title: &str, points: &[CurvePoint]) -> Result<Vec<u8>, MetricsError> {
    let mut canvas = RgbImage::from_pixel(IMAGE_WIDTH as u32, IMAGE_HEIGHT as u32, BACKGROUND);
    draw_title(&mut canvas, title);
    let epoch_axis = epoch_axis(points);

    let train_loss = Series::from_field("train", TRAIN_COLOUR, points, |point| point.train_loss);
    let val_loss = Series::from_field("val", VAL_COLOUR, points, |point| point.val_loss);
    let loss_panel = Panel {
        title: "loss",
        area: plot_area(0),
        x_axis: epoch_axis.clone(),
        y_axis: loss_axis(&[&train_loss, &val_loss]),
        series: vec![train_loss, val_loss],
    };
    draw_panel(&mut canvas, &loss_panel);

    let val_accuracy = Series::from_field("val", VAL_COLOUR, points, |point| point.val_accuracy);
    let accuracy_panel = Panel {
        title: "accuracy",
        area: plot_area(1),
        x_axis: epoch_axis,
        y_axis: accuracy_axis(&val_accuracy),
        series: vec![val_accuracy],
    };
    draw_panel(&mut canvas, &accuracy_panel);

    encode_png(&canvas)
}

// ---------------------------------------------------------------------------------------
// Layout and colours

const IMAGE_WIDTH: i64 = 900;
const IMAGE_HEIGHT: i64 = 430;
const PANEL_WIDTH: i64 = IMAGE_WIDTH / 2;
/// The band at the top that holds the figure's title; the panels start below it.
const TITLE_HEIGHT: i64 = 30;
/// Space kept free on either side of the title.
const TITLE_MARGIN: i64 = 10;
const MARGIN_LEFT: i64 = 90;
const MARGIN_RIGHT: i64 = 20;
const MARGIN_TOP: i64 = 40;
const MARGIN_BOTTOM: i64 = 56;
/// Length of a tick mark outside the plot area, and the gap between it and its label.
const TICK_LENGTH: i64 = 4;
const LABEL_GAP: i64 = 4;
/// Radius of the dot drawn at each data point.
const MARKER_RADIUS: i64 = 3;
/// Length of the line sample in the legend.
const LEGEND_SAMPLE_LENGTH: i64 = 20;
/// Roughly how many intervals an axis is divided into before rounding to a nice step.
const TARGET_INTERVALS: f64 = 6.0;
/// Relative tolerance for treating a value as a multiple of a tick step.
const ROUNDING_SLACK: f64 = 1e-9;
/// Upper bound on ticks per axis, whatever the values.
const MAX_TICKS: usize = 20;
/// A loss at least this many times the next largest is left off the loss axis.
const OUTLIER_RATIO: f64 = 10.0;

const BACKGROUND: Rgb<u8> = Rgb([255, 255, 255]);
const GRID_COLOUR: Rgb<u8> = Rgb([225, 225, 225]);
const AXIS_COLOUR: Rgb<u8> = Rgb([60, 60, 60]);
const TEXT_COLOUR: Rgb<u8> = Rgb([20, 20, 20]);
const TRAIN_COLOUR: Rgb<u8> = Rgb([31, 119, 180]);
const VAL_COLOUR: Rgb<u8> = Rgb([230, 110, 20]);

/// The pixel rectangle inside a panel's axes where data is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
struct PlotArea {
    left: i64,
    top: i64,
    width: i64,
    height: i64,
}

impl PlotArea {
    fn right(&self) -> i64 {
        self.left + self.width
    }

    fn bottom(&self) -> i64 {
        self.top + self.height
    }

    /// The pixel column of an x value, kept inside the area.
    fn x_pixel(&self, axis: &Axis, value: f64) -> i64 {
        let offset = (axis.fraction(value) * self.width as f64).round() as i64;
        self.left + offset.clamp(0, self.width)
    }

    /// The pixel row of a y value (larger values higher up), kept inside the area.
    fn y_pixel(&self, axis: &Axis, value: f64) -> i64 {
        let offset = (axis.fraction(value) * self.height as f64).round() as i64;
        self.bottom() - offset.clamp(0, self.height)
    }
}

/// The plot area of panel `index` (0 = left, 1 = right).
fn plot_area(index: i64) -> PlotArea {
    PlotArea {
        left: index * PANEL_WIDTH + MARGIN_LEFT,
        top: TITLE_HEIGHT + MARGIN_TOP,
        width: PANEL_WIDTH - MARGIN_LEFT - MARGIN_RIGHT,
        height: IMAGE_HEIGHT - TITLE_HEIGHT - MARGIN_TOP - MARGIN_BOTTOM,
    }
}

// ---------------------------------------------------------------------------------------
// Data series and axes

/// One curve: its legend label, colour and finite (epoch, value) points in input order.
#[derive(Clone, Debug)]
struct Series {
    label: &'static str,
    colour: Rgb<u8>,
    points: Vec<(f64, f64)>,
}

impl Series {
    /// Takes one field of every point, dropping points whose value is NaN or infinite.
    fn from_field(
        label: &'static str,
        colour: Rgb<u8>,
        points: &[CurvePoint],
        field: impl Fn(&CurvePoint) -> f64,
    ) -> Series {
        let points = points
            .iter()
            .map(|point| (point.epoch as f64, field(point)))
            .filter(|(_, value)| value.is_finite())
            .collect();
        Series {
            label,
            colour,
            points,
        }
    }
}

/// A value range mapped onto one side of a plot area, with its tick values and labels.
#[derive(Clone, Debug, PartialEq)]
struct Axis {
    min: f64,
    max: f64,
    ticks: Vec<f64>,
    labels: Vec<String>,
}

impl Axis {
    /// Where `value` lies between `min` (0) and `max` (1). Halving both sides keeps the
    /// arithmetic finite even for ranges as wide as all of f64.
    fn fraction(&self, value: f64) -> f64 {
        let span = self.max * 0.5 - self.min * 0.5;
        let fraction = (value * 0.5 - self.min * 0.5) / span;
        if fraction.is_finite() {
            fraction
        } else {
            0.0
        }
    }
}

/// The x axis: every epoch in the input (even one whose values are all skipped), with
/// integer ticks.
fn epoch_axis(points: &[CurvePoint]) -> Axis {
    let epochs: Vec<f64> = points.iter().map(|point| point.epoch as f64).collect();
    nice_axis(&epochs, true)
}

/// The y axis of the loss panel: tight around all finite losses but the outliers
/// (see [`without_outliers`]).
fn loss_axis(series: &[&Series]) -> Axis {
    let values: Vec<f64> = series
        .iter()
        .flat_map(|curve| curve.points.iter().map(|&(_, value)| value))
        .collect();
    nice_axis(&without_outliers(&values), false)
}

/// The finite values less those far above the rest: while the largest is at least
/// [`OUTLIER_RATIO`] times the next largest (a positive one), it goes, up to half of the
/// values.
fn without_outliers(values: &[f64]) -> Vec<f64> {
    let mut kept: Vec<f64> = values
        .iter()
        .copied()
        .filter(|value| value.is_finite())
        .collect();
    kept.sort_by(f64::total_cmp);
    let most_to_drop = kept.len() / 2;
    for _ in 0..most_to_drop {
        let [.., next, largest] = kept[..] else {
            break;
        };
        if next > 0.0 && largest >= next * OUTLIER_RATIO {
            kept.pop();
        } else {
            break;
        }
    }
    kept
}

/// The y axis of the accuracy panel: 0..1 when every accuracy is a fraction, otherwise
/// tight around the values.
fn accuracy_axis(series: &Series) -> Axis {
    let values: Vec<f64> = series.points.iter().map(|&(_, value)| value).collect();
    if values.iter().all(|value| (0.0..=1.0).contains(value)) {
        nice_axis(&[0.0, 1.0], false)
    } else {
        nice_axis(&values, false)
    }
}

/// An axis covering `values` (finite ones only), widened to a multiple of a 1-2-5 step.
/// No values gives 0..1; a single distinct value gets a margin on both sides. With
/// `integer_ticks` the step is at least 1, so ticks fall on whole numbers.
fn nice_axis(values: &[f64], integer_ticks: bool) -> Axis {
    let finite = values.iter().copied().filter(|value| value.is_finite());
    let (low, high) = finite.fold((f64::INFINITY, f64::NEG_INFINITY), |(low, high), value| {
        (low.min(value), high.max(value))
    });
    let (low, high) = if low > high {
        (0.0, 1.0)
    } else {
        widen_if_flat(low, high, integer_ticks)
    };

    let raw_step = (high - low) / TARGET_INTERVALS;
    let step = if integer_ticks {
        nice_step(raw_step).max(1.0)
    } else {
        nice_step(raw_step)
    };
    // The slack keeps values that are a multiple of the step up to rounding (2.2 / 0.2 =
    // 11.000000000000002) from adding a whole extra step.
    let axis_min = (low / step + ROUNDING_SLACK).floor() * step;
    let axis_max = (high / step - ROUNDING_SLACK).ceil() * step;
    if !(step.is_finite() && step > 0.0 && axis_min.is_finite() && axis_max.is_finite()) {
        // Only ranges near the limits of f64 end up here: label just the two ends.
        let ticks = vec![low, high];
        let labels = ticks
            .iter()
            .map(|&tick| format_tick(tick, high - low, high))
            .collect();
        return Axis {
            min: low,
            max: high,
            ticks,
            labels,
        };
    }

    let intervals = ((axis_max - axis_min) / step)
        .round()
        .clamp(0.0, MAX_TICKS as f64) as usize;
    let ticks: Vec<f64> = (0..=intervals)
        .map(|index| axis_min + index as f64 * step)
        .collect();
    let largest = axis_min.abs().max(axis_max.abs());
    let labels = ticks
        .iter()
        .map(|&tick| format_tick(tick, step, largest))
        .collect();
    Axis {
        min: axis_min,
        max: axis_max,
        ticks,
        labels,
    }
}

/// Gives a zero-width range some width so the axis can be drawn: ±1 for integers or zero,
/// ±10% of the value otherwise.
fn widen_if_flat(low: f64, high: f64, integer_ticks: bool) -> (f64, f64) {
    if high > low {
        return (low, high);
    }
    let margin = if integer_ticks || low == 0.0 {
        1.0
    } else {
        low.abs() * 0.1
    };
    let (widened_low, widened_high) = (low - margin, high + margin);
    if widened_high > widened_low {
        (widened_low, widened_high)
    } else {
        // The 10% margin vanished in rounding (subnormal values): fall back to ±1.
        (low - 1.0, high + 1.0)
    }
}

/// The smallest step of the form {1, 2, 5} x 10^k that is at least `raw_step`, give or
/// take rounding noise (1.2 / 6 = 0.20000000000000004 still gives 0.2).
fn nice_step(raw_step: f64) -> f64 {
    let magnitude = 10f64.powf(raw_step.log10().floor());
    let normalized = raw_step / magnitude;
    let factor = [1.0, 2.0, 5.0]
        .into_iter()
        .find(|&factor| normalized <= factor * (1.0 + ROUNDING_SLACK))
        .unwrap_or(10.0);
    factor * magnitude
}

/// A tick label: as many decimals as the step needs, or scientific notation with the
/// mantissa's trailing zeros dropped ("1.5e-4", "2e6") when the numbers are very large or
/// the step very small.
fn format_tick(value: f64, step: f64, largest: f64) -> String {
    // Snap values within rounding noise of zero, so we never print "-0.0".
    let value = if value.abs() < step * 1e-6 {
        0.0
    } else {
        value
    };
    let step_exponent = step.abs().log10().floor();
    if largest >= 1e6 || step_exponent < -4.0 {
        let largest_exponent = largest.abs().log10().floor();
        let precision = (largest_exponent - step_exponent).clamp(0.0, 12.0) as usize;
        let scientific = format!("{value:.precision$e}");
        match scientific.split_once('e') {
            Some((mantissa, exponent)) if mantissa.contains('.') => {
                format!(
                    "{}e{exponent}",
                    mantissa.trim_end_matches('0').trim_end_matches('.')
                )
            }
            _ => scientific,
        }
    } else {
        let decimals = (-step_exponent).clamp(0.0, 4.0) as usize;
        format!("{value:.decimals$}")
    }
}

// ---------------------------------------------------------------------------------------
// Panels

/// Everything one panel shows.
struct Panel {
    title: &'static str,
    area: PlotArea,
    x_axis: Axis,
    y_axis: Axis,
    series: Vec<Series>,
}

/// The figure's title, centred in the band above the panels; a title too wide for the
/// image keeps its end (the run folder's own name and the model) after "...".
fn draw_title(canvas: &mut RgbImage, title: &str) {
    let room = IMAGE_WIDTH - 2 * TITLE_MARGIN;
    let characters: Vec<char> = title.chars().collect();
    let fitting = ((room + TEXT_SCALE) / GLYPH_ADVANCE) as usize;
    let shown: String = if characters.len() <= fitting {
        title.to_string()
    } else {
        let kept = fitting.saturating_sub(3);
        let tail: String = characters[characters.len() - kept..].iter().collect();
        format!("...{tail}")
    };
    let left = (IMAGE_WIDTH - text_width(&shown)) / 2;
    let top = (TITLE_HEIGHT - GLYPH_PIXEL_HEIGHT) / 2 + 4;
    draw_text(canvas, left, top, &shown, TEXT_COLOUR);
}

/// Draws grid, axes, curves, tick labels, title and legend of one panel.
fn draw_panel(canvas: &mut RgbImage, panel: &Panel) {
    draw_grid(canvas, panel);
    draw_axes(canvas, panel);
    // Curves go over the frame so dots on the plot's edges stay whole.
    for series in &panel.series {
        draw_series(canvas, panel, series);
    }
    draw_tick_labels(canvas, panel);
    draw_text(
        canvas,
        panel.area.left,
        TITLE_HEIGHT + MARGIN_TOP / 2 - GLYPH_PIXEL_HEIGHT / 2,
        panel.title,
        TEXT_COLOUR,
    );
    draw_legend(canvas, panel);
}

/// Light lines across the plot area at every tick.
fn draw_grid(canvas: &mut RgbImage, panel: &Panel) {
    let area = panel.area;
    for &tick in &panel.x_axis.ticks {
        let x = area.x_pixel(&panel.x_axis, tick);
        draw_line(canvas, (x, area.top), (x, area.bottom()), GRID_COLOUR, 1);
    }
    for &tick in &panel.y_axis.ticks {
        let y = area.y_pixel(&panel.y_axis, tick);
        draw_line(canvas, (area.left, y), (area.right(), y), GRID_COLOUR, 1);
    }
}

/// A 2 px polyline through the series' points with a dot on each point. A point above
/// the y axis (an outlier left off it) gets its dot on the top edge and its value beside
/// it, and the lines to it end at that edge.
fn draw_series(canvas: &mut RgbImage, panel: &Panel, series: &Series) {
    let area = panel.area;
    let positions: Vec<(f64, f64)> = series
        .points
        .iter()
        .map(|&(epoch, value)| {
            let x = area.left as f64 + panel.x_axis.fraction(epoch) * area.width as f64;
            let y = area.bottom() as f64 - panel.y_axis.fraction(value) * area.height as f64;
            (x, y)
        })
        .collect();
    for segment in positions.windows(2) {
        if let [from, to] = segment {
            if let Some((from, to)) = below_the_top(*from, *to, area.top as f64) {
                draw_line(canvas, rounded(from), rounded(to), series.colour, 2);
            }
        }
    }
    for &(epoch, value) in &series.points {
        let x = area.x_pixel(&panel.x_axis, epoch);
        draw_marker(canvas, x, area.y_pixel(&panel.y_axis, value), series.colour);
        if value > panel.y_axis.max {
            draw_outlier_value(canvas, area, x, value, series.colour);
        }
    }
}

/// The part of the segment from `from` to `to` (pixel positions, y growing downwards)
/// at or below the row `top`; None when it lies wholly above.
fn below_the_top(from: (f64, f64), to: (f64, f64), top: f64) -> Option<((f64, f64), (f64, f64))> {
    let finite = |(x, y): (f64, f64)| x.is_finite() && y.is_finite();
    if !(finite(from) && finite(to)) || (from.1 < top && to.1 < top) {
        return None;
    }
    let onto_top = |above: (f64, f64), below: (f64, f64)| {
        let along = (top - above.1) / (below.1 - above.1);
        (above.0 + (below.0 - above.0) * along, top)
    };
    Some(match (from.1 < top, to.1 < top) {
        (true, _) => (onto_top(from, to), to),
        (_, true) => (from, onto_top(to, from)),
        _ => (from, to),
    })
}

/// A pixel position rounded to the nearest pixel.
fn rounded((x, y): (f64, f64)) -> (i64, i64) {
    (x.round() as i64, y.round() as i64)
}

/// The value of a point above the axis, written beside its dot on the top edge: to the
/// right, or to the left where the right has no room.
fn draw_outlier_value(canvas: &mut RgbImage, area: PlotArea, x: i64, value: f64, colour: Rgb<u8>) {
    let text = value_label(value);
    let gap = MARKER_RADIUS + LABEL_GAP;
    let left = if x + gap + text_width(&text) <= area.right() {
        x + gap
    } else {
        x - gap - text_width(&text)
    };
    draw_text(canvas, left, area.top + LABEL_GAP, &text, colour);
}

/// A value to three significant digits, whole numbers in full, as the ticks are written:
/// "328750", "25.3", "1.8e308".
fn value_label(value: f64) -> String {
    let magnitude = value.abs().log10().floor();
    let step = 10f64.powf(magnitude - 2.0);
    format_tick(value, step, value.abs())
}

/// The frame around the plot area and tick marks pointing out of it.
fn draw_axes(canvas: &mut RgbImage, panel: &Panel) {
    let area = panel.area;
    let corners = [
        (area.left, area.top),
        (area.right(), area.top),
        (area.right(), area.bottom()),
        (area.left, area.bottom()),
    ];
    for (&corner, &next_corner) in corners.iter().zip(corners.iter().cycle().skip(1)) {
        draw_line(canvas, corner, next_corner, AXIS_COLOUR, 1);
    }
    for &tick in &panel.x_axis.ticks {
        let x = area.x_pixel(&panel.x_axis, tick);
        draw_line(
            canvas,
            (x, area.bottom()),
            (x, area.bottom() + TICK_LENGTH),
            AXIS_COLOUR,
            1,
        );
    }
    for &tick in &panel.y_axis.ticks {
        let y = area.y_pixel(&panel.y_axis, tick);
        draw_line(
            canvas,
            (area.left - TICK_LENGTH, y),
            (area.left, y),
            AXIS_COLOUR,
            1,
        );
    }
}

/// Numbers under the x ticks, left of the y ticks, and "epoch" under the x axis.
fn draw_tick_labels(canvas: &mut RgbImage, panel: &Panel) {
    let area = panel.area;
    let x_label_top = area.bottom() + TICK_LENGTH + LABEL_GAP;
    for (&tick, label) in panel.x_axis.ticks.iter().zip(&panel.x_axis.labels) {
        let x = area.x_pixel(&panel.x_axis, tick);
        draw_text(
            canvas,
            x - text_width(label) / 2,
            x_label_top,
            label,
            TEXT_COLOUR,
        );
    }
    for (&tick, label) in panel.y_axis.ticks.iter().zip(&panel.y_axis.labels) {
        let y = area.y_pixel(&panel.y_axis, tick);
        let right = area.left - TICK_LENGTH - LABEL_GAP;
        draw_text(
            canvas,
            right - text_width(label),
            y - GLYPH_PIXEL_HEIGHT / 2,
            label,
            TEXT_COLOUR,
        );
    }
    let caption = "epoch";
    let caption_left = area.left + area.width / 2 - text_width(caption) / 2;
    let caption_top = x_label_top + GLYPH_PIXEL_HEIGHT + 2 * LABEL_GAP;
    draw_text(canvas, caption_left, caption_top, caption, TEXT_COLOUR);
}

/// A line sample with a dot and the label for each series, right-aligned above the plot.
fn draw_legend(canvas: &mut RgbImage, panel: &Panel) {
    let entry_width = |series: &Series| LEGEND_SAMPLE_LENGTH + LABEL_GAP + text_width(series.label);
    let entry_gap = 2 * GLYPH_ADVANCE;
    let total_width: i64 = panel.series.iter().map(entry_width).sum::<i64>()
        + entry_gap * (panel.series.len() as i64 - 1).max(0);
    let center_y = TITLE_HEIGHT + MARGIN_TOP / 2;
    let mut left = panel.area.right() - total_width;
    for series in &panel.series {
        let sample_end = left + LEGEND_SAMPLE_LENGTH;
        draw_line(
            canvas,
            (left, center_y),
            (sample_end, center_y),
            series.colour,
            2,
        );
        draw_marker(
            canvas,
            left + LEGEND_SAMPLE_LENGTH / 2,
            center_y,
            series.colour,
        );
        let text_top = center_y - GLYPH_PIXEL_HEIGHT / 2;
        draw_text(
            canvas,
            sample_end + LABEL_GAP,
            text_top,
            series.label,
            TEXT_COLOUR,
        );
        left += entry_width(series) + entry_gap;
    }
}

// ---------------------------------------------------------------------------------------
// Pixels, lines and markers

/// Colours one pixel; coordinates outside the canvas are ignored.
fn set_pixel(canvas: &mut RgbImage, x: i64, y: i64, colour: Rgb<u8>) {
    let (Ok(x), Ok(y)) = (u32::try_from(x), u32::try_from(y)) else {
        return;
    };
    if let Some(pixel) = canvas.get_pixel_mut_checked(x, y) {
        *pixel = colour;
    }
}

/// Fills a `width` x `height` rectangle whose top-left corner is (`left`, `top`).
fn fill_rect(canvas: &mut RgbImage, left: i64, top: i64, width: i64, height: i64, colour: Rgb<u8>) {
    for y in top..top + height {
        for x in left..left + width {
            set_pixel(canvas, x, y, colour);
        }
    }
}

/// A straight line between two pixels (Bresenham), stamped with a `thickness` x
/// `thickness` square brush. Endpoints are kept on the canvas so the walk stays short.
fn draw_line(
    canvas: &mut RgbImage,
    from: (i64, i64),
    to: (i64, i64),
    colour: Rgb<u8>,
    thickness: i64,
) {
    let clamp_to_canvas = |(x, y): (i64, i64)| (x.clamp(0, IMAGE_WIDTH), y.clamp(0, IMAGE_HEIGHT));
    let (mut x, mut y) = clamp_to_canvas(from);
    let (end_x, end_y) = clamp_to_canvas(to);
    let distance_x = (end_x - x).abs();
    let distance_y = -(end_y - y).abs();
    let step_x = if x < end_x { 1 } else { -1 };
    let step_y = if y < end_y { 1 } else { -1 };
    let mut error = distance_x + distance_y;
    loop {
        fill_rect(canvas, x, y, thickness, thickness, colour);
        if x == end_x && y == end_y {
            break;
        }
        let doubled_error = 2 * error;
        if doubled_error >= distance_y {
            error += distance_y;
            x += step_x;
        }
        if doubled_error <= distance_x {
            error += distance_x;
            y += step_y;
        }
    }
}

/// A filled dot centred on (`center_x`, `center_y`).
fn draw_marker(canvas: &mut RgbImage, center_x: i64, center_y: i64, colour: Rgb<u8>) {
    let radius = MARKER_RADIUS;
    for offset_y in -radius..=radius {
        for offset_x in -radius..=radius {
            // The +1 rounds the dot's outline off instead of leaving single-pixel tips.
            if offset_x * offset_x + offset_y * offset_y <= radius * radius + 1 {
                set_pixel(canvas, center_x + offset_x, center_y + offset_y, colour);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Text: a 5x7 bitmap font drawn at 2x

const GLYPH_WIDTH: i64 = 5;
const GLYPH_HEIGHT: i64 = 7;
/// Each font pixel becomes a TEXT_SCALE x TEXT_SCALE square.
const TEXT_SCALE: i64 = 2;
const GLYPH_PIXEL_HEIGHT: i64 = GLYPH_HEIGHT * TEXT_SCALE;
/// Horizontal distance between the left edges of neighbouring characters.
const GLYPH_ADVANCE: i64 = (GLYPH_WIDTH + 1) * TEXT_SCALE;

/// Glyphs as seven rows of five bits each, top row first, leftmost pixel in bit 4.
#[rustfmt::skip]
const GLYPHS: &[(char, [u8; 7])] = &[
    (' ', [0b00000, 0b00000, 0b00000, 0b00000, 0b00000, 0b00000, 0b00000]),
    ('.', [0b00000, 0b00000, 0b00000, 0b00000, 0b00000, 0b01100, 0b01100]),
    (',', [0b00000, 0b00000, 0b00000, 0b00000, 0b01100, 0b00100, 0b01000]),
    (':', [0b00000, 0b01100, 0b01100, 0b00000, 0b01100, 0b01100, 0b00000]),
    ('/', [0b00001, 0b00001, 0b00010, 0b00100, 0b01000, 0b10000, 0b10000]),
    ('_', [0b00000, 0b00000, 0b00000, 0b00000, 0b00000, 0b00000, 0b11111]),
    ('|', [0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100]),
    ('(', [0b00010, 0b00100, 0b01000, 0b01000, 0b01000, 0b00100, 0b00010]),
    (')', [0b01000, 0b00100, 0b00010, 0b00010, 0b00010, 0b00100, 0b01000]),
    ('=', [0b00000, 0b00000, 0b11111, 0b00000, 0b11111, 0b00000, 0b00000]),
    ('-', [0b00000, 0b00000, 0b00000, 0b01110, 0b00000, 0b00000, 0b00000]),
    ('+', [0b00000, 0b00100, 0b00100, 0b11111, 0b00100, 0b00100, 0b00000]),
    ('0', [0b01110, 0b10001, 0b10011, 0b10101, 0b11001, 0b10001, 0b01110]),
    ('1', [0b00100, 0b01100, 0b00100, 0b00100, 0b00100, 0b00100, 0b01110]),
    ('2', [0b01110, 0b10001, 0b00001, 0b00010, 0b00100, 0b01000, 0b11111]),
    ('3', [0b11111, 0b00010, 0b00100, 0b00010, 0b00001, 0b10001, 0b01110]),
    ('4', [0b00010, 0b00110, 0b01010, 0b10010, 0b11111, 0b00010, 0b00010]),
    ('5', [0b11111, 0b10000, 0b11110, 0b00001, 0b00001, 0b10001, 0b01110]),
    ('6', [0b00110, 0b01000, 0b10000, 0b11110, 0b10001, 0b10001, 0b01110]),
    ('7', [0b11111, 0b00001, 0b00010, 0b00100, 0b01000, 0b01000, 0b01000]),
    ('8', [0b01110, 0b10001, 0b10001, 0b01110, 0b10001, 0b10001, 0b01110]),
    ('9', [0b01110, 0b10001, 0b10001, 0b01111, 0b00001, 0b00010, 0b01100]),
    ('a', [0b00000, 0b00000, 0b01110, 0b00001, 0b01111, 0b10001, 0b01111]),
    ('b', [0b10000, 0b10000, 0b10110, 0b11001, 0b10001, 0b10001, 0b11110]),
    ('c', [0b00000, 0b00000, 0b01110, 0b10000, 0b10000, 0b10001, 0b01110]),
    ('d', [0b00001, 0b00001, 0b01101, 0b10011, 0b10001, 0b10001, 0b01111]),
    ('e', [0b00000, 0b00000, 0b01110, 0b10001, 0b11111, 0b10000, 0b01110]),
    ('f', [0b00110, 0b01001, 0b01000, 0b11100, 0b01000, 0b01000, 0b01000]),
    ('g', [0b00000, 0b01111, 0b10001, 0b10001, 0b01111, 0b00001, 0b01110]),
    ('h', [0b10000, 0b10000, 0b10110, 0b11001, 0b10001, 0b10001, 0b10001]),
    ('i', [0b00100, 0b00000, 0b01100, 0b00100, 0b00100, 0b00100, 0b01110]),
    ('j', [0b00010, 0b00000, 0b00110, 0b00010, 0b00010, 0b10010, 0b01100]),
    ('k', [0b10000, 0b10000, 0b10010, 0b10100, 0b11000, 0b10100, 0b10010]),
    ('l', [0b01100, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0b01110]),
    ('m', [0b00000, 0b00000, 0b11010, 0b10101, 0b10101, 0b10001, 0b10001]),
    ('n', [0b00000, 0b00000, 0b10110, 0b11001, 0b10001, 0b10001, 0b10001]),
    ('o', [0b00000, 0b00000, 0b01110, 0b10001, 0b10001, 0b10001, 0b01110]),
    ('p', [0b00000, 0b00000, 0b11110, 0b10001, 0b11110, 0b10000, 0b10000]),
    ('q', [0b00000, 0b00000, 0b01101, 0b10011, 0b01111, 0b00001, 0b00001]),
    ('r', [0b00000, 0b00000, 0b10110, 0b11001, 0b10000, 0b10000, 0b10000]),
    ('s', [0b00000, 0b00000, 0b01111, 0b10000, 0b01110, 0b00001, 0b11110]),
    ('t', [0b01000, 0b01000, 0b11100, 0b01000, 0b01000, 0b01001, 0b00110]),
    ('u', [0b00000, 0b00000, 0b10001, 0b10001, 0b10001, 0b10011, 0b01101]),
    ('v', [0b00000, 0b00000, 0b10001, 0b10001, 0b10001, 0b01010, 0b00100]),
    ('w', [0b00000, 0b00000, 0b10001, 0b10001, 0b10101, 0b10101, 0b01010]),
    ('x', [0b00000, 0b00000, 0b10001, 0b01010, 0b00100, 0b01010, 0b10001]),
    ('y', [0b00000, 0b00000, 0b10001, 0b10001, 0b01111, 0b00001, 0b01110]),
    ('z', [0b00000, 0b00000, 0b11111, 0b00010, 0b00100, 0b01000, 0b11111]),
];

/// The bitmap of a character; upper case is drawn as lower case. None if the font lacks it.
fn glyph(character: char) -> Option<&'static [u8; 7]> {
    let wanted = character.to_ascii_lowercase();
    GLYPHS
        .iter()
        .find(|(glyph_char, _)| *glyph_char == wanted)
        .map(|(_, rows)| rows)
}

/// Width in pixels of `text` as `draw_text` draws it.
fn text_width(text: &str) -> i64 {
    let characters = text.chars().count() as i64;
    (characters * GLYPH_ADVANCE - TEXT_SCALE).max(0)
}

/// Draws `text` with its top-left corner at (`left`, `top`). Characters missing from the
/// font leave a blank.
fn draw_text(canvas: &mut RgbImage, left: i64, top: i64, text: &str, colour: Rgb<u8>) {
    for (index, character) in text.chars().enumerate() {
        let Some(rows) = glyph(character) else {
            continue;
        };
        let glyph_left = left + index as i64 * GLYPH_ADVANCE;
        for (row, bits) in (0..).zip(rows) {
            for column in 0..GLYPH_WIDTH {
                if (bits >> (GLYPH_WIDTH - 1 - column)) & 1 == 1 {
                    let x = glyph_left + column * TEXT_SCALE;
                    let y = top + row * TEXT_SCALE;
                    fill_rect(canvas, x, y, TEXT_SCALE, TEXT_SCALE, colour);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Encoding

/// The canvas as PNG bytes.
fn encode_png(canvas: &RgbImage) -> Result<Vec<u8>, MetricsError> {
    let mut bytes = Cursor::new(Vec::new());
    canvas
        .write_to(&mut bytes, ImageFormat::Png)
        .map_err(MetricsError::Png)?;
    Ok(bytes.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(epoch: u64, train_loss: f64, val_loss: f64, val_accuracy: f64) -> CurvePoint {
        CurvePoint {
            epoch,
            train_loss,
            val_loss,
            val_accuracy,
        }
    }

    /// Renders without a title and decodes back, checking the PNG's size on the way.
    fn render(points: &[CurvePoint]) -> RgbImage {
        render_titled("", points)
    }

    /// Renders with `title` and decodes back, checking the PNG's size on the way.
    fn render_titled(title: &str, points: &[CurvePoint]) -> RgbImage {
        let bytes = render_training_curves(title, points).expect("rendering succeeds");
        let decoded = image::load_from_memory_with_format(&bytes, ImageFormat::Png)
            .expect("output decodes as PNG")
            .to_rgb8();
        assert_eq!(decoded.dimensions(), (900, 430));
        decoded
    }

    /// The columns of the title band that hold text, as (leftmost, rightmost).
    fn title_columns(image: &RgbImage) -> Option<(i64, i64)> {
        let columns: Vec<i64> = (0..IMAGE_WIDTH)
            .filter(|&x| (0..TITLE_HEIGHT).any(|y| pixel(image, x, y) == TEXT_COLOUR))
            .collect();
        Some((*columns.first()?, *columns.last()?))
    }

    /// A CIFAR-10 ResNet-18 run's first epochs: one huge validation loss, then the usual.
    fn huge_first_val_loss() -> Vec<CurvePoint> {
        vec![
            point(1, 2.1, 328_750.0, 0.1),
            point(2, 1.6, 1.9, 0.35),
            point(3, 1.3, 1.4, 0.5),
            point(4, 1.1, 1.2, 0.58),
        ]
    }

    fn pixel(image: &RgbImage, x: i64, y: i64) -> Rgb<u8> {
        *image.get_pixel(x as u32, y as u32)
    }

    /// How many pixels of `colour` lie inside `area` (frame included).
    fn count_in_area(image: &RgbImage, area: PlotArea, colour: Rgb<u8>) -> usize {
        (area.top..=area.bottom())
            .flat_map(|y| (area.left..=area.right()).map(move |x| (x, y)))
            .filter(|&(x, y)| pixel(image, x, y) == colour)
            .count()
    }

    /// Expected pixel of a data point, computed independently of `PlotArea`'s mapping.
    fn expected_pixel(
        area: PlotArea,
        x_range: (f64, f64),
        y_range: (f64, f64),
        x: f64,
        y: f64,
    ) -> (i64, i64) {
        let x_fraction = (x - x_range.0) / (x_range.1 - x_range.0);
        let y_fraction = (y - y_range.0) / (y_range.1 - y_range.0);
        (
            area.left + (x_fraction * area.width as f64).round() as i64,
            area.bottom() - (y_fraction * area.height as f64).round() as i64,
        )
    }

    /// One plot of a rendered image: its area and the ranges its x and y axes span.
    struct Plot<'a> {
        image: &'a RgbImage,
        area: PlotArea,
        x_range: (f64, f64),
        y_range: (f64, f64),
    }

    impl<'a> Plot<'a> {
        fn new(
            image: &'a RgbImage,
            area: PlotArea,
            x_range: (f64, f64),
            y_range: (f64, f64),
        ) -> Self {
            Plot {
                image,
                area,
                x_range,
                y_range,
            }
        }

        /// Asserts that the data point (`epoch`, `value`) is drawn in `colour`; `what` names
        /// its series.
        fn assert_drawn(&self, epoch: u64, value: f64, colour: Rgb<u8>, what: &str) {
            let (x, y) = expected_pixel(self.area, self.x_range, self.y_range, epoch as f64, value);
            assert_eq!(pixel(self.image, x, y), colour, "{what} of epoch {epoch}");
        }
    }

    fn three_epochs() -> Vec<CurvePoint> {
        vec![
            point(1, 2.0, 2.2, 0.3),
            point(2, 1.5, 1.8, 0.5),
            point(3, 1.0, 1.6, 0.7),
        ]
    }

    #[test]
    fn axes_of_three_epochs_are_nice_and_exact() {
        let points = three_epochs();
        let epochs = epoch_axis(&points);
        assert_eq!((epochs.min, epochs.max), (1.0, 3.0));
        assert_eq!(epochs.labels, ["1", "2", "3"]);

        let train = Series::from_field("train", TRAIN_COLOUR, &points, |p| p.train_loss);
        let val = Series::from_field("val", VAL_COLOUR, &points, |p| p.val_loss);
        let loss = loss_axis(&[&train, &val]);
        // Losses span 1.0..2.2; 1.2 / 6 = 0.2 is already a nice step.
        assert_eq!(loss.min, 1.0);
        assert!((loss.max - 2.2).abs() < 1e-12, "{loss:?}");
        assert_eq!(
            loss.labels,
            ["1.0", "1.2", "1.4", "1.6", "1.8", "2.0", "2.2"]
        );

        let accuracy = accuracy_axis(&Series::from_field("val", VAL_COLOUR, &points, |p| {
            p.val_accuracy
        }));
        assert_eq!((accuracy.min, accuracy.max), (0.0, 1.0));
        assert_eq!(accuracy.labels, ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]);
    }

    #[test]
    fn curves_pass_through_their_data_points() {
        let points = three_epochs();
        let image = render(&points);
        let (loss_area, accuracy_area) = (plot_area(0), plot_area(1));
        let loss = Plot::new(&image, loss_area, (1.0, 3.0), (1.0, 2.2));
        let accuracy = Plot::new(&image, accuracy_area, (1.0, 3.0), (0.0, 1.0));
        for p in &points {
            loss.assert_drawn(p.epoch, p.train_loss, TRAIN_COLOUR, "train loss");
            loss.assert_drawn(p.epoch, p.val_loss, VAL_COLOUR, "val loss");
            accuracy.assert_drawn(p.epoch, p.val_accuracy, VAL_COLOUR, "val accuracy");
        }
        // The line between epochs 1 and 2 of the train loss passes through its midpoint.
        let (x, y) = expected_pixel(loss_area, (1.0, 3.0), (1.0, 2.2), 1.5, 1.75);
        let near_midpoint = (-1..=1).any(|dy| pixel(&image, x, y + dy) == TRAIN_COLOUR);
        assert!(near_midpoint, "train line missing near ({x}, {y})");
    }

    #[test]
    fn train_colour_appears_only_in_the_loss_panel() {
        let image = render(&three_epochs());
        assert!(count_in_area(&image, plot_area(0), TRAIN_COLOUR) > 100);
        assert!(count_in_area(&image, plot_area(0), VAL_COLOUR) > 100);
        assert_eq!(count_in_area(&image, plot_area(1), TRAIN_COLOUR), 0);
        assert!(count_in_area(&image, plot_area(1), VAL_COLOUR) > 100);
        let train_pixels = image
            .pixels()
            .filter(|&&colour| colour == TRAIN_COLOUR)
            .count();
        let right_half_train_pixels = image
            .enumerate_pixels()
            .filter(|(x, _, &colour)| *x >= 450 && colour == TRAIN_COLOUR)
            .count();
        assert!(train_pixels > 0);
        assert_eq!(
            right_half_train_pixels, 0,
            "the accuracy panel has no train curve or legend entry"
        );
    }

    #[test]
    fn empty_input_draws_empty_axes() {
        let image = render(&[]);
        for area in [plot_area(0), plot_area(1)] {
            assert_eq!(count_in_area(&image, area, TRAIN_COLOUR), 0);
            assert_eq!(count_in_area(&image, area, VAL_COLOUR), 0);
            assert_eq!(pixel(&image, area.left, area.top), AXIS_COLOUR);
            assert_eq!(pixel(&image, area.right(), area.bottom()), AXIS_COLOUR);
        }
        let empty = nice_axis(&[], false);
        assert_eq!((empty.min, empty.max), (0.0, 1.0));
    }

    #[test]
    fn single_point_shows_a_dot() {
        let only = point(4, 0.8, 0.9, 0.55);
        let image = render(&[only]);
        let epochs = epoch_axis(&[only]);
        assert_eq!((epochs.min, epochs.max), (3.0, 5.0));
        let loss_axis = nice_axis(&[0.8, 0.9], false);
        let (x, y) = expected_pixel(
            plot_area(0),
            (3.0, 5.0),
            (loss_axis.min, loss_axis.max),
            4.0,
            0.8,
        );
        assert_eq!(pixel(&image, x, y), TRAIN_COLOUR);
        assert_eq!(
            pixel(&image, x + MARKER_RADIUS, y),
            TRAIN_COLOUR,
            "dot is wider than a pixel"
        );
        let (x, y) = expected_pixel(plot_area(1), (3.0, 5.0), (0.0, 1.0), 4.0, 0.55);
        assert_eq!(pixel(&image, x, y), VAL_COLOUR);
    }

    #[test]
    fn non_finite_values_are_skipped() {
        let points = [
            point(1, 2.0, f64::NAN, 0.4),
            point(2, f64::INFINITY, 1.9, f64::NAN),
            point(3, 1.0, f64::NEG_INFINITY, 0.6),
        ];
        let train = Series::from_field("train", TRAIN_COLOUR, &points, |p| p.train_loss);
        assert_eq!(train.points, [(1.0, 2.0), (3.0, 1.0)]);
        let val = Series::from_field("val", VAL_COLOUR, &points, |p| p.val_loss);
        assert_eq!(val.points, [(2.0, 1.9)]);
        let loss = loss_axis(&[&train, &val]);
        assert!(loss.min <= 1.0 && loss.max >= 2.0 && loss.max.is_finite());

        let image = render(&points);
        let (x, y) = expected_pixel(plot_area(0), (1.0, 3.0), (loss.min, loss.max), 3.0, 1.0);
        assert_eq!(pixel(&image, x, y), TRAIN_COLOUR);

        let all_nan = [
            point(1, f64::NAN, f64::NAN, f64::NAN),
            point(2, f64::NAN, f64::NAN, f64::NAN),
        ];
        let image = render(&all_nan);
        for area in [plot_area(0), plot_area(1)] {
            assert_eq!(count_in_area(&image, area, TRAIN_COLOUR), 0);
            assert_eq!(count_in_area(&image, area, VAL_COLOUR), 0);
        }
    }

    #[test]
    fn constant_values_get_a_nonzero_span() {
        let flat = nice_axis(&[2.0, 2.0, 2.0], false);
        assert!(flat.min < 2.0 && flat.max > 2.0, "{flat:?}");
        let zero = nice_axis(&[0.0], false);
        assert!(zero.min < 0.0 && zero.max > 0.0, "{zero:?}");
        let epoch = nice_axis(&[7.0, 7.0], true);
        assert_eq!((epoch.min, epoch.max), (6.0, 8.0));
        assert_eq!(epoch.labels, ["6", "7", "8"]);
        let tiny = nice_axis(&[f64::MIN_POSITIVE / 4.0], false);
        assert!(tiny.min < tiny.max, "{tiny:?}");
        render(&[point(1, 0.5, 0.5, 0.5), point(2, 0.5, 0.5, 0.5)]);
    }

    #[test]
    fn tick_labels_round_sensibly() {
        assert_eq!(
            nice_axis(&[0.13, 0.87], false).labels,
            ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]
        );
        assert_eq!(
            nice_axis(&[1.0, 10.0], true).labels,
            ["0", "2", "4", "6", "8", "10"]
        );
        assert_eq!(
            nice_axis(&[-0.3, 0.3], false).labels,
            ["-0.3", "-0.2", "-0.1", "0.0", "0.1", "0.2", "0.3"]
        );
        assert_eq!(
            nice_axis(&[0.0, 3e6], false).labels,
            ["0e0", "5e5", "1e6", "1.5e6", "2e6", "2.5e6", "3e6"]
        );
        assert_eq!(
            nice_axis(&[0.00012, 0.00035], false).labels,
            ["1e-4", "1.5e-4", "2e-4", "2.5e-4", "3e-4", "3.5e-4"]
        );
        assert_eq!(
            nice_axis(&[120.0, 480.0], false).labels,
            ["100", "200", "300", "400", "500"]
        );
    }

    #[test]
    fn extreme_values_render_without_panicking() {
        render(&[
            point(0, -f64::MAX, f64::MAX, -5.0),
            point(u64::MAX, f64::MIN_POSITIVE, 1e300, 1e300),
        ]);
        render(&[point(u64::MAX, 1.0, 1.0, 1.0)]);
        let points: Vec<CurvePoint> = (0..1000)
            .map(|epoch| point(epoch, 1.0 / (epoch + 1) as f64, 0.5, 0.9))
            .collect();
        render(&points);
    }

    #[test]
    fn glyphs_cover_every_label() {
        let mut texts: Vec<String> = [
            "loss",
            "accuracy",
            "train",
            "val",
            "epoch",
            "0123456789.-e",
            "s3://runs/cifar_2 | resnet-base",
        ]
        .iter()
        .map(|text| text.to_string())
        .collect();
        texts.push(('a'..='z').collect());
        let axes = [
            nice_axis(&[0.13, 0.87], false),
            nice_axis(&[-3.7, 12.5], false),
            nice_axis(&[0.0, 3e6], false),
            nice_axis(&[-2e-7, 1e-6], false),
            nice_axis(&[-f64::MAX, f64::MAX], false),
            nice_axis(&[0.0, u64::MAX as f64], true),
        ];
        texts.extend(axes.iter().flat_map(|axis| axis.labels.clone()));
        texts.extend([328_750.0, 0.5, -3.0, f64::MAX].map(value_label));
        for text in &texts {
            for character in text.chars() {
                assert!(
                    glyph(character).is_some(),
                    "no glyph for {character:?} in {text:?}"
                );
            }
        }
        for (character, rows) in GLYPHS {
            assert!(
                rows.iter().all(|&row| row < 1 << GLYPH_WIDTH),
                "glyph {character:?} wider than 5"
            );
            assert_eq!(
                GLYPHS
                    .iter()
                    .filter(|(other, _)| other == character)
                    .count(),
                1,
                "{character:?} twice"
            );
        }
    }

    #[test]
    fn text_is_drawn_at_twice_the_font_size() {
        let mut canvas = RgbImage::from_pixel(20, 20, BACKGROUND);
        draw_text(&mut canvas, 1, 1, "1", TEXT_COLOUR);
        // '1' has its top pixel in column 2 of row 0 and a full bottom row in columns 1..=3.
        assert_eq!(pixel(&canvas, 1 + 2 * 2, 1), TEXT_COLOUR);
        assert_eq!(pixel(&canvas, 1 + 2 * 2 + 1, 2), TEXT_COLOUR);
        assert_eq!(pixel(&canvas, 1, 1), BACKGROUND);
        let bottom_row = 1 + 6 * 2;
        let lit: Vec<i64> = (0..20)
            .filter(|&x| pixel(&canvas, x, bottom_row) == TEXT_COLOUR)
            .collect();
        assert_eq!(lit, (3..9).collect::<Vec<i64>>());
        assert_eq!(text_width("loss"), 4 * 12 - 2);
        assert_eq!(text_width(""), 0);
    }

    #[test]
    fn lines_are_two_pixels_wide() {
        let mut canvas = RgbImage::from_pixel(30, 30, BACKGROUND);
        draw_line(&mut canvas, (5, 10), (25, 10), TRAIN_COLOUR, 2);
        let column: Vec<i64> = (0..30)
            .filter(|&y| pixel(&canvas, 15, y) == TRAIN_COLOUR)
            .collect();
        assert_eq!(column, [10, 11]);
        let mut canvas = RgbImage::from_pixel(30, 30, BACKGROUND);
        draw_line(&mut canvas, (25, 25), (5, 5), VAL_COLOUR, 1);
        assert!((5..=25).all(|i| pixel(&canvas, i, i) == VAL_COLOUR));
        // Far off-canvas endpoints are clamped, not walked.
        draw_line(
            &mut canvas,
            (i64::MIN, i64::MIN),
            (i64::MAX, i64::MAX),
            VAL_COLOUR,
            2,
        );
    }

    #[test]
    fn a_loss_far_above_the_rest_is_left_off_the_axis() {
        // The case: 328,750 once, then losses near 1.
        let losses = [2.1, 1.6, 1.3, 1.1, 328_750.0, 1.9, 1.4, 1.2];
        assert_eq!(
            without_outliers(&losses),
            [1.1, 1.2, 1.3, 1.4, 1.6, 1.9, 2.1]
        );
        // Two of them, each ten times the next.
        assert_eq!(
            without_outliers(&[5000.0, 2.0, 1.0, 328_750.0, 1.5]),
            [1.0, 1.5, 2.0]
        );
        // An ordinary run keeps every value, as do a steady fall and losses of zero.
        let ordinary = [2.3, 1.8, 1.5, 1.3, 2.2, 1.9, 1.7, 1.6];
        assert_eq!(without_outliers(&ordinary).len(), 8);
        assert_eq!(without_outliers(&[50.0, 20.0, 8.0, 3.0, 1.0, 0.4]).len(), 6);
        assert_eq!(without_outliers(&[5.0, 0.0, 0.0]), [0.0, 0.0, 5.0]);
        // Never more than half of the values go.
        assert_eq!(without_outliers(&[1e9, 1e6, 1e3, 1.0]), [1.0, 1e3]);
        assert_eq!(without_outliers(&[7.0, f64::NAN, f64::INFINITY]), [7.0]);

        let points = huge_first_val_loss();
        let train = Series::from_field("train", TRAIN_COLOUR, &points, |p| p.train_loss);
        let val = Series::from_field("val", VAL_COLOUR, &points, |p| p.val_loss);
        let axis = loss_axis(&[&train, &val]);
        assert!((axis.min, axis.max) == (1.0, 2.2), "{axis:?}");
        assert_eq!(value_label(328_750.0), "328750");
        assert_eq!(value_label(25.34), "25.3");
        assert_eq!(value_label(f64::MAX), "1.8e308");
    }

    #[test]
    fn an_outlier_sits_on_the_top_edge_and_the_other_losses_keep_their_detail() {
        let points = huge_first_val_loss();
        let image = render(&points);
        let area = plot_area(0);
        let loss = Plot::new(&image, area, (1.0, 4.0), (1.0, 2.2));
        for p in &points {
            loss.assert_drawn(p.epoch, p.train_loss, TRAIN_COLOUR, "train loss");
        }
        for p in &points[1..] {
            loss.assert_drawn(p.epoch, p.val_loss, VAL_COLOUR, "val loss");
        }
        // Epoch 1's validation loss: a dot on the top edge, its value to the right.
        assert_eq!(pixel(&image, area.left, area.top), VAL_COLOUR);
        let label_left = area.left + MARKER_RADIUS + LABEL_GAP;
        let mut label = RgbImage::from_pixel(IMAGE_WIDTH as u32, IMAGE_HEIGHT as u32, BACKGROUND);
        draw_text(
            &mut label,
            label_left,
            area.top + LABEL_GAP,
            "328750",
            VAL_COLOUR,
        );
        let label_pixels: Vec<(u32, u32)> = label
            .enumerate_pixels()
            .filter(|(_, _, colour)| **colour == VAL_COLOUR)
            .map(|(x, y, _)| (x, y))
            .collect();
        assert!(label_pixels.len() > 50);
        for &(x, y) in &label_pixels {
            assert_eq!(*image.get_pixel(x, y), VAL_COLOUR, "label pixel ({x}, {y})");
        }
        // The line from it comes down to epoch 2's value, entering through the top edge
        // just left of epoch 2 (the outlier is 150,000 axis heights up).
        let (x2, _) = expected_pixel(area, (1.0, 4.0), (1.0, 2.2), 2.0, 1.9);
        let top_row: Vec<i64> = (area.left + MARKER_RADIUS + 1..=area.right())
            .filter(|&x| pixel(&image, x, area.top + 1) == VAL_COLOUR)
            .filter(|&x| x > label_left + text_width("328750"))
            .collect();
        assert!(
            !top_row.is_empty() && top_row.iter().all(|&x| (x2 - 2..=x2 + 1).contains(&x)),
            "{top_row:?} vs {x2}"
        );
        // With a linear axis up to 328,750 the ordinary losses would share one row.
        let linear = nice_axis(&[1.1, 328_750.0], false);
        let rows: Vec<i64> = [2.1, 1.6, 1.3, 1.1]
            .iter()
            .map(|&value| area.y_pixel(&linear, value))
            .collect();
        assert_eq!(rows, [area.bottom(); 4]);
    }

    #[test]
    fn segments_end_where_they_leave_the_plot() {
        assert_eq!(
            below_the_top((0.0, -90.0), (10.0, 10.0), 0.0),
            Some(((9.0, 0.0), (10.0, 10.0)))
        );
        assert_eq!(
            below_the_top((0.0, 10.0), (10.0, -10.0), 0.0),
            Some(((0.0, 10.0), (5.0, 0.0)))
        );
        assert_eq!(below_the_top((0.0, -1.0), (10.0, -5.0), 0.0), None);
        assert_eq!(
            below_the_top((0.0, 1.0), (10.0, 5.0), 0.0),
            Some(((0.0, 1.0), (10.0, 5.0)))
        );
        assert_eq!(
            below_the_top((0.0, f64::NEG_INFINITY), (1.0, 1.0), 0.0),
            None
        );
    }

    #[test]
    fn the_title_is_drawn_centred_above_the_panels() {
        let points = three_epochs();
        assert_eq!(
            title_columns(&render(&points)),
            None,
            "no title, no text there"
        );
        let title = "runs/demo | resnet-base";
        let image = render_titled(title, &points);
        let (left, right) = title_columns(&image).expect("the title is drawn");
        let width = text_width(title);
        let expected_left = (IMAGE_WIDTH - width) / 2;
        // The first and last glyphs ('r' and 'e') have ink in their first and last columns.
        assert_eq!((left, right), (expected_left, expected_left + width - 1));
        // Each glyph of the title is where draw_text puts it: compare with the text alone.
        let mut alone = RgbImage::from_pixel(IMAGE_WIDTH as u32, IMAGE_HEIGHT as u32, BACKGROUND);
        draw_title(&mut alone, title);
        for y in 0..TITLE_HEIGHT {
            for x in 0..IMAGE_WIDTH {
                assert_eq!(pixel(&image, x, y), pixel(&alone, x, y), "at ({x}, {y})");
            }
        }
        // The glyph of '|' is a vertical bar: a column of 14 text pixels at its centre.
        let bar_left = expected_left + 10 * GLYPH_ADVANCE + 2 * TEXT_SCALE;
        let bar: Vec<i64> = (0..TITLE_HEIGHT)
            .filter(|&y| pixel(&image, bar_left, y) == TEXT_COLOUR)
            .collect();
        assert_eq!(bar.len() as i64, GLYPH_PIXEL_HEIGHT, "{bar:?}");
        // A title wider than the image keeps its end.
        let long = format!("s3://bucket/{}/run-7 | resnet18", "deep/".repeat(30));
        let image = render_titled(&long, &points);
        let (left, right) = title_columns(&image).expect("the long title is drawn");
        assert!(
            left >= TITLE_MARGIN && right < IMAGE_WIDTH - TITLE_MARGIN,
            "{left}..{right}"
        );
    }
}
