/**
 * The type deploy/grafana/dashboards/tally.json must have: Grafana 10.4's own dashboard types,
 * as published in @grafana/schema 10.4.2 (the version of the compose image, grafana-oss:10.4.2).
 * tests/integration/test_dashboard_schema.py writes dashboard.ts,
 *
 *     import type { TallyDashboard } from "./check";
 *     export const dashboard: TallyDashboard = <the text of tally.json>;
 *
 * and runs `tsc -p .` (strict, no emit): the JSON is checked as an object literal, so a wrong
 * type, a missing required field or a key the types do not know is a compiler error.
 *
 * Where this file departs from @grafana/schema's `Dashboard`, it says why: string enums are
 * written as their values (JSON has no enums); a panel's options, custom field config and
 * targets, untyped records in `Panel`, get the generated types of the panel plugins and of the
 * Prometheus query that the dashboard uses; and one field the 10.4 schema lacks is allowed.
 */
import type {
  Dashboard,
  FieldConfig,
  FieldConfigSource,
  Panel,
  RowPanel,
  VariableModel,
} from "@grafana/schema";
// The panel plugins' and the Prometheus data source's generated types ship in the same package
// but are not re-exported from its index; without them a panel's `options`, its
// `fieldConfig.defaults.custom` and its `targets` are untyped records (Record<string, unknown>).
import type { PrometheusDataQuery } from "@grafana/schema/dist/esm/raw/composable/prometheus/dataquery/x/PrometheusDataQuery_types.gen";
import type * as stat from "@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen";
import type * as timeseries from "@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen";

/**
 * JSON has no enums: where the types name a string enum (FieldColorModeId, ThresholdsMode,
 * BigValueColorMode, ...), the JSON holds one of its values, so each string enum is replaced by
 * the union of its values, at any depth. Numeric enums accept their numbers as they are.
 */
export type Json<T> = T extends string
  ? `${T}`
  : T extends readonly (infer U)[]
    ? Json<U>[]
    : T extends object
      ? { [K in keyof T]: Json<T[K]> }
      : T;

interface FieldDefaults<Custom> extends Omit<FieldConfig, "custom"> {
  custom?: Custom;
}

interface Fields<Custom> extends Omit<FieldConfigSource, "defaults"> {
  defaults: FieldDefaults<Custom>;
}

/**
 * A panel of plugin `Type` querying Prometheus. `options` is Partial: the plugin's generated
 * Options mark fields that have a default as required, and Grafana fills a missing option from
 * that default when it loads the panel (the stat panel's showPercentChange and wideLayout, new
 * in 10.x, are not in our JSON).
 */
interface QueryPanel<Type extends string, Options, Custom>
  extends Omit<Panel, "type" | "options" | "fieldConfig" | "targets"> {
  type: Type;
  options?: Partial<Options>;
  fieldConfig?: Fields<Custom>;
  targets?: PrometheusDataQuery[];
}

/** The panel plugins the dashboard uses; another one needs its generated types added here. */
export type TallyPanel =
  | QueryPanel<"timeseries", timeseries.Options, Partial<timeseries.FieldConfig>>
  // the stat panel has no custom field config in 10.4
  | QueryPanel<"stat", stat.Options, Record<string, never>>;

interface TallyRow extends Omit<RowPanel, "panels"> {
  panels: TallyPanel[];
}

/**
 * The one widening: `definition`, the query as the variable editor displays it, is written by
 * Grafana's own query-variable editor and read back by it, but is missing from the 10.4 schema.
 */
interface TallyVariable extends VariableModel {
  definition?: string;
}

interface Dashboard_ extends Omit<Dashboard, "panels" | "templating"> {
  panels?: (TallyPanel | TallyRow)[];
  templating?: { list?: TallyVariable[] };
}

export type TallyDashboard = Json<Dashboard_>;
