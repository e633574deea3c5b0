// The script of the replay's HTML report (tools/report.c embeds it in the
// page after the data, REPORT): draws the settings, the summary, tune's
// answers and, per device, the timeline and the segment map, as plain SVG
// with no library. Built into the tool as a string (cmake/embed.cmake).
'use strict';
const KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024, TiB = GiB * 1024;
const SVG = 'http://www.w3.org/2000/svg';

function el(tag, attrs, parent) {
  const e = document.createElementNS(SVG, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}
function html(tag, text, parent, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = text;
  if (cls) e.className = cls;
  if (parent) parent.appendChild(e);
  return e;
}
function tip(node, text) { el('title', {}, node).textContent = text; }

// Bytes for a reader: three decimals of GiB from 1 GiB, else one of MiB, KiB or bytes.
function fmt(b) {
  if (b >= GiB) return (b / GiB).toFixed(3) + ' GiB';
  if (b >= MiB) return (b / MiB).toFixed(1) + ' MiB';
  if (b >= KiB) return (b / KiB).toFixed(1) + ' KiB';
  return b + ' B';
}
function count(n) { return Number(n).toLocaleString('en-US'); }
function pct(x) { return (x >= 0 ? '+' : '') + (100 * x).toFixed(2) + '%'; }

// An axis: ticks at 1, 2 or 5 times a power of ten of `unit`, about `want` of them up to `max`
// (whole numbers of the unit at least, with `whole`: operations).
function ticks(max, want, unit, whole) {
  const raw = Math.max(max / unit, 1e-9) / want;
  const p = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = Math.max(whole ? unit : 0, (raw / p <= 1 ? 1 : raw / p <= 2 ? 2 : raw / p <= 5 ? 5 : 10) * p * unit);
  const out = [];
  for (let v = 0; v <= max * (1 + 1e-9) + step * 1e-9; v += step) out.push(v);
  if (out[out.length - 1] < max) out.push(out[out.length - 1] + step);
  return out;
}
function byteUnit(max) {
  return max >= TiB ? [TiB, 'TiB'] : max >= GiB ? [GiB, 'GiB'] : max >= MiB ? [MiB, 'MiB']
       : max >= KiB ? [KiB, 'KiB'] : [1, 'B'];
}
function tickLabel(v, unit) { return String(+(v / unit[0]).toFixed(3)) + ' ' + unit[1]; }
function opsLabel(v) {
  return v >= 1e6 ? +(v / 1e6).toFixed(2) + 'M' : v >= 1e4 ? +(v / 1e3).toFixed(1) + 'k' : count(v);
}

// "k:v,k:[a,b],..." as pairs (commas inside brackets belong to the value).
function parseSettings(s) {
  const out = new Map();
  let depth = 0, start = 0;
  for (let i = 0; i <= s.length; i++) {
    const ch = s[i];
    if (ch === '[') depth++;
    else if (ch === ']') depth--;
    else if ((ch === ',' && depth === 0) || i === s.length) {
      const item = s.slice(start, i).trim();
      start = i + 1;
      if (!item) continue;
      const colon = item.indexOf(':');
      if (colon < 0) out.set(item, '');
      else out.set(item.slice(0, colon), item.slice(colon + 1));
    }
  }
  return out;
}

function settingsTable(host) {
  const inForce = parseSettings(REPORT.settings), defaults = parseSettings(REPORT.defaults);
  const keys = [...new Set([...inForce.keys(), ...defaults.keys()])];
  const set = k => (inForce.get(k) ?? 'unset') !== (defaults.get(k) ?? 'unset');
  keys.sort((a, b) => (set(b) - set(a)) || a.localeCompare(b));
  const t = html('table', null, host, 'settings');
  const head = t.insertRow();
  for (const c of ['setting', 'in force', 'default']) html('th', c, head);
  for (const k of keys) {
    const r = t.insertRow();
    if (set(k)) r.className = 'set';
    html('td', k, r, 'key');
    html('td', inForce.get(k) ?? 'unset', r);
    html('td', defaults.get(k) ?? 'unset', r);
  }
  const n = keys.filter(set).length;
  html('p', n ? n + ' setting' + (n === 1 ? '' : 's') + ' differ from the defaults (in bold, first).'
              : 'Every setting at its default.', host, 'note');
}

const COLORS = {requested: '#2ca02c', allocated: '#1f77b4', reserved: '#d62728', recorded: '#ff7f0e'};
const LABELS = {requested: 'requested', allocated: 'allocated (gcalloc)', reserved: 'reserved (gcalloc)',
                recorded: 'reserved (PyTorch, recorded)'};
// tune's answers, drawn dotted over the run shown.
const ANSWER_COLORS = ['#9467bd', '#8c564b', '#17becf', '#7f7f7f'];

// Where point i of a series of `step` stands: 0 is the start of recording, then the end of each stretch.
function opAt(i, step, ops) { return i === 0 ? 0 : Math.min(i * step, ops); }

function timeline(dev, host, answers) {
  const W = 960, H = 340, L = 84, R = 24, T = 16, B = 44;
  const svg = el('svg', {width: W, height: H, class: 'timeline'}, host);
  // Lines that often coincide stay visible: PyTorch's recorded reserved first, wide and dashed; allocated
  // wide under gcalloc's reserved; requested thin and dashed on top.
  const names = ['recorded', 'allocated', 'reserved', 'requested'].filter(n => dev[n]);
  const lines = names.map(s => ({name: s, values: dev[s], step: dev.step, ops: dev.operations, label: LABELS[s],
                                 color: COLORS[s], width: {recorded: 5, allocated: 4, reserved: 2, requested: 1.5}[s],
                                 dash: {recorded: '8 4', requested: '3 3'}[s] || 'none', cls: 'series-' + s}));
  answers.forEach((a, k) => {
    const d = a.devices.find(x => x.device === dev.device);
    if (!d || !d.reserved) return;
    lines.push({name: 'answer' + k, values: d.reserved, step: d.step, ops: d.operations,
                label: 'reserved, ' + a.label + (d.oom ? ' (out of memory)' : ''),
                color: ANSWER_COLORS[k % ANSWER_COLORS.length], width: 1.5, dash: '2 3', cls: 'series-answer'});
  });
  const ops = Math.max(1, ...lines.map(l => l.ops));
  let top = 1;
  for (const l of lines) for (const v of l.values) if (v > top) top = v;
  if (dev.bound_reserved > top) top = dev.bound_reserved;
  // The capacity is drawn when it is near the data; far above it would flatten every line.
  const cap = REPORT.capacity, capShown = cap > 0 && cap <= 1.25 * top;
  if (capShown) top = Math.max(top, cap);
  const unit = byteUnit(top), yt = ticks(top, 5, unit[0]), ymax = yt[yt.length - 1];
  const xt = ticks(ops, 8, 1, true), xmax = xt[xt.length - 1];
  const x = op => L + op / xmax * (W - L - R);
  const y = v => T + (1 - v / ymax) * (H - T - B);
  el('rect', {x: L, y: T, width: W - L - R, height: H - T - B, fill: '#fafafa', stroke: '#bbb'}, svg);
  for (const v of yt) {
    el('line', {x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: '#e4e4e4'}, svg);
    el('text', {x: L - 6, y: y(v) + 4, 'text-anchor': 'end', 'font-size': 11, class: 'ytick'}, svg).textContent =
        tickLabel(v, unit);
  }
  for (const v of xt) {
    el('line', {x1: x(v), x2: x(v), y1: H - B, y2: H - B + 5, stroke: '#888'}, svg);
    el('text', {x: x(v), y: H - B + 17, 'text-anchor': 'middle', 'font-size': 11, class: 'xtick'}, svg).textContent =
        opsLabel(v);
  }
  el('text', {x: (L + W - R) / 2, y: H - 6, 'text-anchor': 'middle', 'font-size': 12}, svg).textContent =
      'operations since recording began (' + count(dev.operations) + ' replayed' +
      (dev.step > 1 ? '; each point the maximum over ' + count(dev.step) : '') + ')';
  el('text', {x: 14, y: (T + H - B) / 2, 'text-anchor': 'middle', 'font-size': 12,
              transform: 'rotate(-90 14 ' + (T + H - B) / 2 + ')'}, svg).textContent = 'bytes (' + unit[1] + ')';
  // The bound's label under its line at the left, the capacity's over its line at the right: they can be close.
  const level = (v, color, text, cls, right) => {
    el('line', {x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: color, 'stroke-dasharray': '3 3', class: cls}, svg);
    el('text', {x: right ? W - R - 4 : L + 4, y: right ? y(v) - 4 : y(v) + 13, 'text-anchor': right ? 'end' : 'start',
                'font-size': 11, fill: color}, svg).textContent = text;
  };
  if (dev.bound_reserved) level(dev.bound_reserved, '#555', 'lower bound ' + fmt(dev.bound_reserved), 'bound', false);
  if (capShown) level(cap, '#000', 'capacity ' + fmt(cap), 'capacity', true);
  for (const l of lines) {
    const pts = l.values.map((v, i) => x(opAt(i, l.step, l.ops)).toFixed(1) + ',' + y(v).toFixed(1)).join(' ');
    el('polyline', {points: pts, fill: 'none', stroke: l.color, 'stroke-width': l.width, 'stroke-dasharray': l.dash,
                    'stroke-linejoin': 'round', class: l.cls}, svg);
  }
  if (dev.seeded && !dev.oom_seeding) {
    el('circle', {cx: x(0), cy: y(dev.reserved[0]), r: 4, fill: '#333'}, svg);
    el('text', {x: L + 8, y: T + 30, 'font-size': 11, fill: '#333', class: 'start-note'}, svg).textContent =
        count(dev.seeded) + ' allocations (' + fmt(dev.requested[0]) + ') were live when recording began';
  }
  if (dev.oom) {
    const at = x(dev.operations), left = at - L < 260;
    el('line', {x1: at, x2: at, y1: T, y2: H - B, stroke: '#d62728', 'stroke-dasharray': '4 2'}, svg);
    el('text', {x: left ? at + 4 : at - 4, y: H - B - 8, 'text-anchor': left ? 'start' : 'end', 'font-size': 11,
                fill: '#d62728', class: 'oom-mark'}, svg).textContent = dev.oom_seeding
        ? 'out of memory making the ' + count(dev.seeded) + ' allocations live when recording began'
        : 'out of memory at operation ' + count(dev.operations + 1);
  }
  const cursor = el('line', {y1: T, y2: H - B, stroke: '#888', visibility: 'hidden'}, svg);
  const readout = html('div', '', host, 'readout');
  svg.addEventListener('mousemove', ev => {
    const r = svg.getBoundingClientRect();
    const op = Math.max(0, Math.min(ops, (ev.clientX - r.left - L) / (W - L - R) * xmax));
    cursor.setAttribute('x1', x(op)); cursor.setAttribute('x2', x(op)); cursor.setAttribute('visibility', 'visible');
    readout.textContent = 'operation ' + count(Math.round(op)) + ': ' + lines.map(l => {
      const i = Math.min(l.values.length - 1, Math.ceil(op / l.step));
      return l.label + ' ' + fmt(l.values[i]);
    }).join(', ');
  });
  const legend = html('div', null, host, 'legend');
  for (const l of lines) {
    const item = html('span', null, legend);
    const sw = html('i', null, item);
    sw.style.background = l.color;
    item.appendChild(document.createTextNode(l.label));
  }
  if (cap > 0 && !capShown) html('span', 'capacity ' + fmt(cap) + ' (above the plot)', legend);
}

// Not the timeline's colours: a test counts those to see that the plot was drawn.
const BLOCK_COLORS = ['#6a51a3', '#fdae6b', '#dddddd'], UNMAPPED_COLOR = '#9ecae1';
const STATES = ['allocated', 'pending free', 'free', 'unmapped'];
const READOUT_FRAMES = 3; // frames the line under the map shows; the tooltip shows them all

// Where a block came from (its origin in the data): live when recording
// began, or allocated from a call stack of the trace's (innermost first).
function originText(origin, frames) {
  if (origin === -1) return 'live when recording began';
  const stack = origin > 0 && REPORT.stacks && REPORT.stacks[origin];
  if (!stack) return '';
  const lines = stack.split('\n');
  return 'allocated at' + (frames ? ' ' + lines.slice(0, frames).join(' < ') + (lines.length > frames ? ' < ...' : '')
                                  : '\n  ' + lines.join('\n  '));
}

function segmentMap(dev, host) {
  const segs = dev.segments;
  if (!segs.length) { html('p', 'No segments at the peak.', host); return; }
  const legend = html('div', null, host, 'legend');
  STATES.forEach((name, k) => {
    if (k === 3 && !segs.some(g => g.range)) return;
    const item = html('span', null, legend);
    const sw = html('b', null, item);
    sw.style.background = k === 3 ? UNMAPPED_COLOR : BLOCK_COLORS[k];
    item.appendChild(document.createTextNode(name));
  });
  if (dev.stacks_unnamed)
    html('p', count(dev.stacks_unnamed) + ' blocks are drawn without their call stacks: the page holds ' +
        count(REPORT.stacks_most) + ' stacks at most.', host, 'note');
  const W = 960, L = 200, R = 24, ROW = 14, TOP = 24, biggest = Math.max(...segs.map(g => g.size));
  const unit = byteUnit(biggest), xt = ticks(biggest, 6, unit[0]), span = xt[xt.length - 1];
  const scale = (W - L - R) / span;
  const svg = el('svg', {width: W, height: TOP + segs.length * ROW + 4, class: 'segments'}, host);
  for (const v of xt) {
    el('line', {x1: L + v * scale, x2: L + v * scale, y1: TOP - 6, y2: TOP + segs.length * ROW, stroke: '#eee'}, svg);
    el('text', {x: L + v * scale, y: TOP - 9, 'text-anchor': 'middle', 'font-size': 10, class: 'scale'}, svg)
        .textContent = tickLabel(v, unit);
  }
  const readout = html('div', '', host, 'readout');
  segs.forEach((g, r) => {
    const y = TOP + r * ROW + 1;
    const row = el('g', {class: 'row'}, svg);
    const what = (g.range ? 'expandable range' : 'segment') + ' at 0x' + g.address.toString(16) + ': ' + fmt(g.size) +
        ', ' + g.pool + ' pool, stream ' + g.stream + ', ' + fmt(g.allocated) + ' allocated' +
        (g.count > 1 ? '; ' + g.count + ' identical segments' : '');
    tip(row, what);
    el('text', {x: L - 6, y: y + ROW - 4, 'text-anchor': 'end', 'font-size': 10}, row).textContent =
        (g.count > 1 ? g.count + ' \u00d7 ' : '') + fmt(g.size) + ' ' + g.pool + (g.range ? ' range' : '');
    el('rect', {x: L, y: y, width: Math.max(1, g.size * scale), height: ROW - 3, fill: BLOCK_COLORS[2],
                class: g.range ? 'range' : 'segment'}, row);
    const part = (at, size, state, text, origin) => {
      const e = el('rect', {x: L + at * scale, y: y, width: Math.max(0.5, size * scale), height: ROW - 3,
                            fill: state === 3 ? UNMAPPED_COLOR : BLOCK_COLORS[state],
                            class: state === 3 ? 'unmapped' : 'block'}, row);
      const long = originText(origin, 0), short = originText(origin, READOUT_FRAMES);
      tip(e, what + '\n' + text + (long ? '\n' + long : ''));
      e.addEventListener('mouseenter', () => { readout.textContent = what + ' | ' + text + (short ? ' | ' + short : ''); });
    };
    if (g.blocks.length) {
      let at = 0;
      for (const [size, state, requested, origin] of g.blocks) {
        const text = STATES[state] + ' ' + fmt(size) + (requested ? ' (requested ' + fmt(requested) + ')' : '') +
            ' at offset ' + fmt(at) + (g.count > 1 && origin ? ' (of the first of these segments)' : '');
        if (state !== 2 || g.blocks.length > 1) part(at, size, state, text, origin);
        at += size;
      }
    } else {
      part(0, g.allocated, 0, fmt(g.allocated) + ' allocated (blocks not listed: too many in the report)', 0);
    }
  });
  if (dev.segments_left_out)
    html('p', '... and ' + count(dev.segments_left_out) + ' smaller segments.', host);
}

function pagesLine(dev, host) {
  const p = dev.pages;
  if (!p) return;
  const a = p.at_peak;
  html('p', 'Expandable segments: ' + count(p.mapped) + ' pages mapped and ' + count(p.unmapped) +
      ' unmapped over the replay (' + count(p.moved) + ' of each moved by stitching). At the peak: ' +
      count(a.mapped_pages) + ' pages mapped (' + fmt(a.mapped_bytes) + ', ' + count(a.free_pages) +
      ' of them free), ' + count(a.unmapped_pages) + ' unmapped below the top of ' + a.ranges + ' range' +
      (a.ranges === 1 ? '' : 's') + ' (' + fmt(a.unmapped_bytes) + ').', host, 'pages');
}

function summary(devs, host) {
  const t = html('table', null, host, 'summary');
  const head = t.insertRow();
  html('th', '', head);
  for (const d of devs) html('th', d.name, head);
  const line = (label, cell) => {
    const r = t.insertRow();
    html('th', label, r, 'key');
    for (const d of devs) html('td', cell(d), r);
  };
  line('operations replayed', d => count(d.events));
  line('live when recording began', d => d.seeded ? count(d.seeded) + ' allocations' +
      (d.start_segments ? ' (in ' + d.start_segments + ' segments as recorded)' : '') : 'nothing');
  line('peak requested', d => fmt(d.peak_requested));
  line('peak allocated', d => fmt(d.peak_allocated));
  line('peak reserved', d => fmt(d.peak_reserved) +
      (d.peak_requested ? ' (' + (d.peak_reserved / d.peak_requested).toFixed(3) + ' \u00d7 requested)' : ''));
  line('lower bound', d => !d.bound_reserved ? '' : fmt(d.bound_reserved) +
      (d.oom ? ' (the whole sequence\'s)' : ' (peak reserved ' + pct(d.peak_reserved / d.bound_reserved - 1) + ')'));
  line('PyTorch reserved (recorded)', d => d.recorded_peak_reserved === null ? 'unknown: no segments recorded'
      : d.recorded_peak_reserved === 0 ? 'none (no segment in the record)'
      : fmt(d.recorded_peak_reserved) + ' (gcalloc / PyTorch ' + (d.peak_reserved / d.recorded_peak_reserved).toFixed(3) + ')');
  if (devs.some(d => d.recorded_peak_reserved !== null))
    line('PyTorch\'s segment events reproduced', d => d.recorded_peak_reserved === null ? ''
        : count(d.segment_events_matched) + ' of ' + count(d.segment_events_recorded));
  line('fits', d => d.oom ? (d.oom_seeding ? 'no: the allocations live at the start do not'
                             : 'no: out of memory at operation ' + count(d.operations + 1))
      : REPORT.capacity ? 'yes: ' + fmt(Math.max(0, REPORT.capacity - d.peak_reserved)) + ' to spare at the peak'
      : 'yes (no capacity given)');
  if (devs.some(d => d.pages))
    line('pages mapped at the peak (unmapped below the top)', d => d.pages
        ? count(d.pages.at_peak.mapped_pages) + ' (' + count(d.pages.at_peak.unmapped_pages) + ')' : '');
  for (const d of devs)
    if (d.oom) html('p', d.name.replace(/^d/, 'D') + ' does not fit: ' + d.oom, host, 'oom');
}

function answersTable(host) {
  const A = REPORT.answers;
  html('h2', 'Settings tune found', host);
  const t = html('table', null, host, 'answers');
  const head = t.insertRow();
  for (const c of ['', 'configuration', 'peak reserved', 'against the defaults', 'above the lower bound', 'fits'])
    html('th', c, head);
  const total = (a, f) => a.devices.reduce((s, d) => s + f(d), 0);
  const defaults = A.find(a => a.conf === '');
  const bound = total(A[0], d => d.bound_reserved);
  for (const a of A) {
    const r = t.insertRow();
    html('th', a.label, r, 'key');
    const c = html('td', null, r, 'conf');
    html('code', a.conf ? a.env + '=' + a.conf : '(defaults)', c);
    const peak = total(a, d => d.peak_reserved), fits = a.devices.every(d => !d.oom);
    html('td', fmt(peak), r);
    html('td', !defaults || a === defaults || !fits || defaults.devices.some(d => d.oom) ? ''
        : pct(peak / total(defaults, d => d.peak_reserved) - 1), r);
    html('td', fits && bound ? pct(peak / bound - 1) : '', r);
    html('td', fits ? 'yes' : 'no', r);
  }
  if (REPORT.answers_note) html('p', REPORT.answers_note, host, 'note');
}

function draw() {
  document.getElementById('title').textContent = 'gcalloc replay of ' + REPORT.trace;
  document.getElementById('conf').textContent = REPORT.conf || '(defaults)';
  document.getElementById('capacity').textContent = REPORT.capacity
      ? fmt(REPORT.capacity) + ' per device' : 'none given: the simulated device is unlimited (8 TiB)';
  const head = document.getElementById('head');
  settingsTable(document.getElementById('settings'));
  const shown = REPORT.devices.filter(d => !d.empty), empty = REPORT.devices.filter(d => d.empty);
  summary(shown, head);
  if (empty.length)
    html('p', empty.map(d => d.name.replace(/^d/, 'D')).join(', ') + ': nothing recorded on ' +
        (empty.length === 1 ? 'it' : 'them') + '.', head, 'empty');
  if (REPORT.stacks_left_out)
    html('p', 'The segment maps do not say where each block was allocated: the snapshot is ' +
        fmt(REPORT.stacks_left_out) + ', and its call stacks are read up to ' + fmt(REPORT.stacks_limit) +
        ' unless --stacks is given.', head, 'note');
  const answers = REPORT.answers || [];
  if (answers.length) answersTable(head);
  for (const d of shown) {
    const sec = html('section', null, document.getElementById('devices'));
    html('h2', d.name.replace(/^d/, 'D'), sec);
    timeline(d, sec, answers.filter(a => a.conf !== REPORT.conf));
    html('h3', 'Segments at gcalloc\'s peak reserved (' + (d.peak_at ? 'operation ' + count(d.peak_at)
        : 'when recording began') + '): ' + (d.pages ? 'expandable ranges up to their highest mapped page, then ' : '') +
        'segments largest first, identical ones on one row', sec);
    pagesLine(d, sec);
    segmentMap(d, sec);
  }
  document.body.setAttribute('data-drawn', REPORT.devices.length);
}
draw();
